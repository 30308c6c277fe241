"""The shape of the library's code: function lengths, module sizes, public parameter lists.

    python benchmarks/code_shape.py            # a summary and the outliers
    python benchmarks/code_shape.py --json     # the same as JSON
    python benchmarks/code_shape.py --with-docstrings
    python benchmarks/code_shape.py --root ../other-checkout   # another tree (e.g. before a change)

The library is ``planner/`` and ``solvers/`` (not tests, benchmarks or examples). A function's
length is its lines from ``def`` to its last line less its docstring's (``--with-docstrings``
counts those too); nested functions count on their own too. A public parameter list belongs to a function or method whose name and module
do not start with ``_``; it counts every named parameter but ``self`` and ``cls`` (``*args`` and
``**kwargs`` are not names). The issue's bar (#26): the longest function under 60 lines, no
public parameter list over 8 names, no module over 600 lines.
"""

from __future__ import annotations

import ast
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("planner", "solvers")
MAX_FUNCTION_LINES = 59
MAX_PUBLIC_PARAMETERS = 8
MAX_MODULE_LINES = 600


def _modules(root: Path) -> list[Path]:
    return sorted(p for top in LIBRARY for p in (root / top).rglob("*.py"))


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _docstring_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return [n for n in names if n not in ("self", "cls")]


def _public(root: Path, path: Path, name: str) -> bool:
    parts = path.relative_to(root).with_suffix("").parts
    return not name.startswith("_") and not any(p.startswith("_") and p != "__init__" for p in parts)


def measure(root: Path = ROOT, *, with_docstrings: bool = False) -> dict:
    functions, modules, wide = [], {}, []
    for path in _modules(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        modules[rel] = len(text.splitlines())
        for fn in _functions(ast.parse(text)):
            lines = fn.end_lineno - fn.lineno + 1 - (0 if with_docstrings else _docstring_lines(fn))
            functions.append((lines, f"{rel}:{fn.lineno} {fn.name}"))
            params = _parameters(fn)
            if _public(root, path, fn.name) and len(params) > MAX_PUBLIC_PARAMETERS:
                wide.append((len(params), f"{rel}:{fn.lineno} {fn.name}"))
    lengths = sorted(n for n, _ in functions)
    return {
        "functions": len(lengths),
        "median_lines": statistics.median(lengths),
        "p90_lines": lengths[int(0.9 * (len(lengths) - 1))],
        "longest": sorted(functions, reverse=True)[:10],
        "over_function_limit": sum(n > MAX_FUNCTION_LINES for n in lengths),
        "modules": len(modules),
        "largest_modules": sorted(((n, m) for m, n in modules.items()), reverse=True)[:10],
        "modules_over_limit": sorted(m for m, n in modules.items() if n > MAX_MODULE_LINES),
        "public_parameter_lists_over_limit": sorted(wide, reverse=True),
    }


def main() -> None:
    root = Path(sys.argv[sys.argv.index("--root") + 1]) if "--root" in sys.argv else ROOT
    shape = measure(root, with_docstrings="--with-docstrings" in sys.argv)
    if "--json" in sys.argv:
        print(json.dumps(shape, indent=1))
        return
    print(f"{shape['functions']} functions: median {shape['median_lines']} lines, p90 {shape['p90_lines']}, "
          f"{shape['over_function_limit']} over {MAX_FUNCTION_LINES}")
    print("longest:", *(f"  {n:4d}  {where}" for n, where in shape["longest"]), sep="\n")
    print(f"{shape['modules']} modules; over {MAX_MODULE_LINES} lines: {shape['modules_over_limit'] or 'none'}")
    print("largest:", *(f"  {n:4d}  {m}" for n, m in shape["largest_modules"]), sep="\n")
    wide = shape["public_parameter_lists_over_limit"]
    print(f"public parameter lists over {MAX_PUBLIC_PARAMETERS} names: {len(wide)}",
          *(f"  {n:4d}  {where}" for n, where in wide), sep="\n")


if __name__ == "__main__":
    main()
