"""Load a user's ``model.py`` and run its code with errors a user can act on.

The model-file convention::

    build_model() -> torch.nn.Module        # required
    example_inputs() -> Tensor | tuple | dict   # required: model(x), model(*args) or model(**kwargs)
    loss_fn(output) -> scalar Tensor        # optional; default: see ``default_loss``
    loss_fn(output, batch) -> scalar Tensor # ... or with the batch (labels): see ``loss_arity``

Everything that can go wrong with the file (missing, not Python, syntax error, a function
missing, user code raising, wrong return types) raises ``ModelLoadError`` with one message
that names the fix. A user's exception is shown with the frames from their own file only:
the bug is there, not in importlib or torch.

Example::

    mf = load_model_file("examples/gpt2.py")
    model, batch = mf.build_model(), mf.example_inputs()
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import itertools
import math
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner.crashes import CalledExit
from planner.errors import ModelLoadError, ProfileError
from planner.profiling.units import io_tensors
from planner.files import as_path, device_kind

Inputs = torch.Tensor | tuple | dict
"""What ``example_inputs()`` returns: one tensor, positional args, or keyword args."""

TEMPLATE = """\
import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
def example_inputs():
    return torch.randn(32, 64)  # a tensor, a tuple of positional args, or a dict of kwargs
def loss_fn(output): return output.square().mean()  # optional"""

_REQUIRED = ("build_model", "example_inputs")


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file. ``build_model`` and ``example_inputs`` check what they return."""

    build_model: Callable[[], torch.nn.Module]
    example_inputs: Callable[..., Inputs]
    """``example_inputs()``, or ``example_inputs(seq_len=..., batch=...)`` for another shape (``SHAPE_KEYWORDS``)."""
    loss_fn: Callable[[Any], torch.Tensor] | None
    path: Path


def load_model_file(path: str | Path) -> ModelFile:
    """Import ``path`` and return its ``build_model``, ``example_inputs`` and optional ``loss_fn``.

    The file's folder is on ``sys.path`` while its code runs (at import and in every call of
    the returned functions), as it would be for ``python model.py``, so it can import its
    neighbours.

    Raises:
        ModelLoadError: the file is missing or not a ``.py`` file, has a syntax error, raises
            at import, or lacks ``build_model`` / ``example_inputs``.
    """
    path = as_path(path, "the path of a model file")
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist; check the path")
    if path.is_dir():
        hint = f"; did you mean {path / 'model.py'}?" if (path / "model.py").exists() else ""
        raise ModelLoadError(f"{path} is a directory, not a model file{hint}")
    if kind := device_kind(path):
        raise ModelLoadError(f"model file {path} is {kind}; pass the Python file that defines build_model() and "
                             f"example_inputs()")
    if path.suffix != ".py":
        raise ModelLoadError(f"model file {path} is not a .py file{_saved_kind(path)}; pass the Python file that "
                             f"defines build_model() and example_inputs()")
    path = path.resolve()
    module = _import(path)
    for name in _REQUIRED:  # defined, but not as a function (NOTE [ Model-file messages name the fix ])
        value = getattr(module, name, None)
        if value is not None and not callable(value):
            kind = type(value).__name__
            raise ModelLoadError(f"{path}: {name} is {'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}, not a "
                                 f"function; define it as `def {name}(): ...`")
    missing = [name for name in _REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        names = " and ".join(f"{n}()" for n in missing)
        raise ModelLoadError(f"{path} does not define {names}; a valid model file looks like:\n{TEMPLATE}")
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelLoadError(f"{path}: loss_fn is a {type(loss_fn).__name__}, not a function; "
                             f"define it as `def loss_fn(output): ...` or remove it")
    for name in (*_REQUIRED, "loss_fn"):  # Rule 3 of NOTE [ Model-file messages name the fix ]
        if _is_async(getattr(module, name, None)):
            raise ModelLoadError(f"{path}: {name} is an async function (async def), so calling it gives a coroutine, "
                                 f"not a value; define it with def (inside, asyncio.run(...) can await what it needs)")
    try:
        loss_arity(loss_fn)
    except ProfileError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return ModelFile(
        build_model=lambda: _build(module.build_model, path),
        example_inputs=lambda **shape: _inputs(module.example_inputs, path, shape),
        loss_fn=loss_fn,
        path=path,
    )


_SAVED_KINDS = {"remat-plan": ": it is a plan file (remat verify takes the model file first: remat verify MODEL.py "
                               "PLAN.json)",
                "remat-profile": ": it is a profile (remat plan takes it as --profile PATH, in place of the model "
                                  "file)"}


def _saved_kind(path: Path) -> str:
    """What the file is when it is one of remat's own (a plan or a profile, named by its ``kind`` near the start),
    for the message that refuses it as a model file; '' otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(256).decode("utf-8", "replace")
    except OSError:
        return ""
    found = re.search(r'"kind"\s*:\s*"(remat-[a-z]+)"', head)
    return _SAVED_KINDS.get(found.group(1), "") if found else ""


def _import(path: Path) -> Any:
    # a file name is bytes to the system: one that is not UTF-8 (b'\xff') reaches here with surrogates, which
    # str.encode() refused ("internal error: UnicodeEncodeError", round 19 probe); the module name keeps ASCII
    stem = re.sub(r"[^0-9A-Za-z_]", "_", path.stem)
    name = f"remat_model_{stem}_{hashlib.sha1(os.fsencode(path)).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"cannot import {path}; is it a Python source file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        with _on_sys_path(path.parent):
            spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        where = f"{e.filename or path}:{e.lineno}" if e.lineno else str(path)
        text = f"\n    {e.text.rstrip()}" if e.text else ""
        raise ModelLoadError(f"syntax error in {where} ({e.msg}); fix the line:{text}") from None
    except SystemExit as e:
        del sys.modules[name]
        raise ModelLoadError(f"importing {path} {called_exit(e)}; put the file's script code under "
                             f"`if __name__ == '__main__':`") from None
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ModelLoadError(
            f"importing {path} raised {_describe(e)}{_import_fix(e, path)}\n{user_frames(e, only_file=path)}"
        ) from e
    return module


# NOTE [ Model-file messages name the fix ]
#
# A model file is run as a script: its folder is on sys.path while it is imported, it belongs to no
# package. Two mistakes a user makes under that convention get the fix in the message, not only the
# symptom. Rule 1: a relative import (`from .layers import block`), whose ImportError says "no known
# parent package", is told to import the sibling module by name. Rule 2: build_model or
# example_inputs bound to something that is not a function (`build_model = MyModel()`) is named as
# what it is; "does not define build_model()" was said of a file that does define it. Rule 3: build_model,
# example_inputs or loss_fn defined with ``async def``, or a module's forward so, gives a coroutine when called:
# the file is refused naming the function (``async def build_model`` was "returned a coroutine; it must return a
# torch.nn.Module" and then Python's three-line "coroutine ... was never awaited" warning, round 19 probe).


def _import_fix(e: BaseException, path: Path) -> str:
    """Rule 1 of NOTE [ Model-file messages name the fix ]."""
    if isinstance(e, ImportError) and "no known parent package" in str(e):
        return (f"; a model file is imported on its own, in no package: import its neighbours by name "
                f"(e.g. `from layers import block`; {path.parent} is on sys.path while it loads)")
    return ""


def _build(fn: Callable[[], Any], path: Path) -> torch.nn.Module:
    model = _call_user(fn, path, "build_model()")
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(f"build_model() in {path} returned a {type(model).__name__}; it must return "
                             f"a torch.nn.Module (the model itself, not a tuple or a state_dict)")
    check_trainable(model, f"the model from build_model() in {path}")
    found = next((name for name, m in model.named_modules() if _is_async(type(m).forward)), None)
    if found is not None:  # Rule 3 of NOTE [ Model-file messages name the fix ]
        raise ModelLoadError(f"the model from build_model() in {path}: {type(model.get_submodule(found)).__name__}"
                             f"{f' ({found!r})' if found else ''} has an async forward (async def), which torch "
                             f"calls as a plain function, getting a coroutine; define forward with def")
    return model


def check_trainable(model: torch.nn.Module, which: str) -> None:
    """``ModelLoadError`` when ``model`` (``which``: how the message names it) has no parameter that trains: the
    optimizer would raise "got an empty parameter list" mid-profile; or when the model, or a module in it, is compiled
    already (NOTE [ A model compiled before remat sees it ]). One check for a model file and a module."""
    _check_uncompiled(model, which)
    if not any(True for _ in model.parameters()):
        raise ModelLoadError(f"{which} has no parameters: there is nothing to train, so nothing to plan; "
                             f"return the model you train")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelLoadError(f"{which} has no trainable parameters (all have requires_grad=False): nothing to "
                             f"train. Unfreeze at least one parameter")


SHAPE_KEYWORDS = ("batch", "seq_len")
"""Keyword arguments a model file's ``example_inputs`` may take to make a batch of another shape
(``remat plan --seq-len 128,256 --batch 4,8 model.py``: a bucketed plan)."""


def _inputs(fn: Callable[..., Any], path: Path, shape: dict[str, int]) -> Inputs:
    if shape:
        check_shape_keywords(fn, shape, f"example_inputs() in {path}")
        fn = functools.partial(fn, **shape)
    inputs = _call_user(fn, path, "example_inputs(" + ", ".join(f"{k}={v}" for k, v in shape.items()) + ")")
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    if isinstance(inputs, tuple):
        return inputs
    if isinstance(inputs, Mapping):  # e.g. a tokenizer's BatchEncoding
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise ModelLoadError(f"example_inputs() in {path} returned a dict with non-string key {bad[0]!r}; "
                                 f"keys must be the forward() argument names")
        return dict(inputs)
    raise ModelLoadError(f"example_inputs() in {path} returned a {type(inputs).__name__}; return a tensor "
                         f"(model(x)), a tuple of positional args (model(*args)) or a dict of keyword "
                         f"args (model(**kwargs))")


def check_shape_keywords(fn: Callable[..., Any], shape: dict[str, int], what: str) -> None:
    """``ModelLoadError`` naming how to opt in, unless ``fn`` takes every keyword of ``shape``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in shape if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY]
    if missing:
        raise ModelLoadError(f"{what} takes no {missing[0]} keyword, so it cannot make a batch of another shape; "
                             f"let it take {' and '.join(SHAPE_KEYWORDS)} with today's values as defaults, e.g. "
                             f"def example_inputs(seq_len=128, batch=8)")


def _is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine or an async generator (Rule 3 of NOTE [ Model-file messages name
    the fix ])."""
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def _call_user(fn: Callable[[], Any], path: Path, what: str) -> Any:
    try:
        with _on_sys_path(path.parent):
            return fn()
    except (KeyboardInterrupt, ModelLoadError):
        raise
    except SystemExit as e:
        raise ModelLoadError(f"{what} in {path} {called_exit(e)}; return a value or raise an exception "
                             f"instead") from None
    except BaseException as e:
        raise ModelLoadError(f"{what} in {path} raised {_describe(e)}\n{user_frames(e, only_file=path)}") from e


def called_exit(e: SystemExit) -> str:
    """``called sys.exit(3)``: how a model file's ``sys.exit`` (or ``exit()``) is worded in an error. remat runs
    the file's code in its own process, so an exit there would end remat without saying why. ``os._exit`` is
    named with where it was called (NOTE [ Exits that skip remat ] in planner/crashes.py)."""
    if isinstance(e, CalledExit):
        return f"called {e.call}"
    return f"called sys.exit({e.code!r})" if e.code is not None else "called sys.exit()"


@contextlib.contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    entry = str(folder)
    if entry in sys.path:
        yield
        return
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


# ----------------------------------------------------------------------------- tracebacks

def _dirs(*paths: str) -> tuple[str, ...]:
    return tuple(os.path.normcase(os.path.realpath(p)) + os.sep for p in paths)


_OWN_DIRS = _dirs(os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIRS = _dirs(sysconfig.get_paths()["stdlib"])
_THIRD_PARTY_DIRS = _dirs(sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])


def user_frames(exc: BaseException, *, only_file: str | Path | None = None, limit: int = 3) -> str:
    """The last ``limit`` traceback frames of ``exc`` that are the user's code, formatted.

    With ``only_file``, only frames from that file; otherwise every frame outside torch,
    this package and the standard library (so a Hugging Face model's frames are kept).
    Returns '' when no frame qualifies.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    if only_file is not None:
        target = os.path.normcase(os.path.realpath(only_file))
        keep = [f for f in frames if os.path.normcase(os.path.realpath(f.filename)) == target]
    else:
        keep = [f for f in frames if not _is_library(f.filename)]
    return "\n".join(f'  File "{f.filename}", line {f.lineno}, in {f.name}' + (f"\n    {f.line.strip()}" if f.line else "")
                     for f in keep[-limit:])


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return True
    path = os.path.normcase(os.path.realpath(filename))
    if path.startswith(_OWN_DIRS):
        return True
    # site-packages may sit inside the stdlib folder (system Python): third-party code is kept
    return path.startswith(_STDLIB_DIRS) and not path.startswith(_THIRD_PARTY_DIRS)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ----------------------------------------------------------------------------- calling the model


def call_model(model: torch.nn.Module, inputs: Inputs) -> Any:
    """``model(x)`` for a tensor, ``model(*args)`` for a tuple, ``model(**kwargs)`` for a dict."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


LOSS_SIGNATURES = "loss_fn(output) or loss_fn(output, batch)"
"""The signatures a loss function may have, as errors list them."""


def loss_arity(loss_fn: Callable[..., Any] | None) -> int:
    """How many arguments ``loss_fn`` takes: 1 (``output``) or 2 (``output, batch``: the batch as
    ``example_inputs()`` returned it, e.g. to read its labels). None (the default loss) takes 1. A
    function that can take two positional arguments gets two; one that cannot take one, or needs
    more than two, is ``ProfileError`` listing the accepted signatures. A callable whose signature
    Python cannot read (a builtin) gets one."""
    if loss_fn is None:
        return 1
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return 1
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind is not p.VAR_POSITIONAL
                and p.kind is not p.VAR_KEYWORD]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) <= 2 and all(p in positional for p in required) and (len(positional) >= 2 or varargs):
        return 2
    if len(required) <= 1 and all(p in positional for p in required) and (positional or varargs):
        return 1
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    raise ProfileError(f"loss_fn {name}{sig} cannot be called as {LOSS_SIGNATURES}; define it with one of "
                       f"these signatures")


def compute_loss(loss_fn: Callable[..., Any] | None, output: Any, batch: Any, *, arity: int | None = None) -> Any:
    """``loss_fn(output)`` or ``loss_fn(output, batch)`` by ``loss_arity`` (``arity``: already known, as a
    step that calls it every micro-batch passes it); ``default_loss`` when None. Every caller of a user's
    loss function goes through here."""
    if loss_fn is None:
        return default_loss(output)
    return loss_fn(output, batch) if (arity or loss_arity(loss_fn)) == 2 else loss_fn(output)


def default_loss(output: Any) -> torch.Tensor:
    """The loss when ``model.py`` has no ``loss_fn``.

    ``output.loss`` (attribute or key) when it is a tensor, as Hugging Face models return when
    given labels; otherwise the sum of every floating-point tensor in the output, looking
    through tuples, lists, dicts, ``ModelOutput`` and dataclasses (``units.io_tensors``, as the
    profiler finds a module's outputs). Low-precision tensors are summed in
    float32 so the loss does not overflow.
    """
    loss = _loss_member(output)
    if isinstance(loss, torch.Tensor):
        return loss
    floats = [t for t in io_tensors(output) if t.is_floating_point()]
    if not floats:
        raise ProfileError(f"the model output ({type(output).__name__}) holds no floating-point tensor to "
                           f"use as a loss; define loss_fn(output) in the model file")
    total = _sum(floats[0])
    for t in floats[1:]:
        total = total + _sum(t)
    return total


def _loss_member(output: Any) -> Any:
    if isinstance(output, Mapping):
        return output.get("loss")
    if isinstance(output, (torch.Tensor, tuple, list)):
        return None
    return getattr(output, "loss", None)


def _sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()


def check_loss(loss: Any, *, finite: bool = False, amp: str | None = None,
               params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Return ``loss`` if it can be back-propagated (and with ``finite``, is not NaN or infinite: ``check_finite``
    with the recipe's ``amp`` and the trainable ``params``); raise ``ProfileError`` naming the fix if not."""
    if not isinstance(loss, torch.Tensor):
        raise ProfileError(f"loss_fn must return a scalar tensor, got a {type(loss).__name__}")
    if loss.numel() != 1:
        raise ProfileError(f"loss_fn must return a scalar tensor, got shape {list(loss.shape)}; "
                           f"reduce it, e.g. .mean()")
    if not loss.is_floating_point():
        raise ProfileError(f"loss_fn must return a floating-point scalar, got {loss.dtype}; "
                           f"compute the loss from the model's floating-point outputs")
    if not loss.requires_grad:
        raise ProfileError("the loss does not require grad, so backward() would do nothing: is the "
                           "forward run under torch.no_grad(), or does loss_fn detach the output?")
    if finite:
        check_finite(loss, amp, params)
    return loss


# NOTE [ A model compiled before remat sees it ]
#
# ``build_model()`` that returns ``torch.compile(model)``, or compiles its blocks in place (``m.layers[i] =
# torch.compile(layer)``, as torchtitan's per-block compile does), hides the modules remat hooks: the profiler's
# timeline and the measured step disagreed, "error: cannot reconcile the profiled timeline with the step as you run
# it: ... +203.98%; the step's memory differs from one run to the next" (round 19 probe, both forms), which blames
# the wrong thing. Rule 1. A model that is, or holds, a ``torch.compile`` wrapper (an ``OptimizedModule``) is refused
# before profiling, naming the module and the fix: return it uncompiled and pass --compile (``compile=`` in
# Python), which plans the step as compiled; ``apply_plan`` then goes before ``torch.compile`` in training, as
# ``apply_plan`` itself says of a compiled model. Rule 2. A compiled function the forward calls is not a module:
# it is profiled as it runs (its ops stay visible to the profiler).


def _check_uncompiled(model: torch.nn.Module, which: str) -> None:
    """Rule 1 of NOTE [ A model compiled before remat sees it ]."""
    from planner.act.applier import compiled_module

    found = next((name for name, m in model.named_modules() if compiled_module(m) is not None), None)
    if found is None:
        return
    what = "is a torch.compile'd module" if found == "" else f"holds a torch.compile'd module, {found!r},"
    raise ModelLoadError(f"{which} {what} whose modules remat cannot profile one by one; return it uncompiled and "
                         f"pass --compile (compile='inductor' in Python), which plans the step as torch.compile runs it; in "
                         f"training, apply the plan before compiling")


# NOTE [ A loss that is not finite ]
#
# Rule 1. A loss that is NaN or infinite is refused (``ProfileError``, exit 2), not profiled: its
#   gradients are NaN or infinite, so the backward remat would time and plan is not the one training
#   runs; under fp16 the GradScaler then skips ``optimizer.step()``, so the optimizer's state, a third
#   of a plain AdamW step's memory, is never created or measured. No plan made from such a step holds.
# Rule 2. The loss is read on the first step a step function runs (every micro-batch of it): the
#   profiler's and verify's warm-up step, which nothing measures. Reading a value is a device sync on
#   CUDA; in every measured step it would stall the GPU between forward and backward. Profiling trains
#   at lr=0 on one batch, so each later step computes the same loss.
# Rule 3. Fake tensors (``--device meta``) have no values: nothing is read there.
# Rule 4. ``verify`` runs its steps with ``finite_loss=False``: it compares a plan against the plain
#   model, and says where gradients hold NaN or inf without the plan (NOTE [ Comparing non-finite values ]).
# Rule 5. After the first step's backward, at least one trainable parameter must hold a gradient: a
#   loss that no parameter reaches (``torch.tensor(1.0, requires_grad=True)``, a constant) makes an empty
#   backward and no optimizer state, and is refused the same way (``check_grads_reached``).
# Rule 6. A loss that is not finite because the parameters are not (an earlier step's ``optimizer.step()`` spoilt
#   them) says so, and the usual cause: pure float16 parameters with Adam or AdamW, whose eps of 1e-08 is 0 in
#   float16, so a parameter whose gradient is 0 gets 0/0. Round 19 probe: a ``.half()`` model was "the loss is nan
#   in the first training step ... look for a log or square root of a number <= 0", said of remat's validation
#   step, after the profiled steps had spoilt 20 of its tensors (their first loss was finite).
# Why: log of a negative number, a division by zero and an fp16 overflow in the loss were profiled and
# planned as if fine (round 17 probes: 4 of 4 models with a NaN or inf loss got a plan, exit 0), and so
# was a loss made as a new leaf tensor, which no parameter reaches.


def check_finite(loss: torch.Tensor, amp: str | None = None, params: Sequence[torch.Tensor] = ()) -> None:
    """``ProfileError`` if ``loss`` is NaN or infinite (NOTE [ A loss that is not finite ]); ``amp``: the
    recipe's, for the hint; ``params``: the trainable parameters, which an earlier step may have spoilt (Rule 6)."""
    value = float(loss.detach().float())
    if math.isfinite(value):
        return
    spoilt = [t for t in params if not bool(torch.isfinite(t.detach()).all())]
    if spoilt:  # Rule 6
        half = (": float16 parameters are updated in float16, where an eps below 6e-08 (Adam's and AdamW's 1e-08) "
                "is 0 and a zero gradient divides 0 by 0; keep the parameters in float32 and pass --amp fp16 or bf16 "
                "for mixed precision" if any(t.dtype == torch.float16 for t in spoilt) else
                "; look for an optimizer setting that divides by zero or a learning-rate schedule that overflows")
        raise ProfileError(f"the loss is {value} because {len(spoilt)} of the model's {len(params)} trainable "
                           f"parameter tensors hold NaN or inf before this step: an earlier optimizer.step() made "
                           f"them so, and training would do the same{half}")
    cause = ("an fp16 overflow (try --amp bf16), " if amp == "fp16" else
             "an overflow in low precision, " if loss.dtype in (torch.float16, torch.bfloat16) else "")
    raise ProfileError(f"the loss is {value} in the first training step, so every gradient and the backward remat "
                       f"would measure are garbage; make the loss finite (look for {cause}a log or square root of a "
                       f"number <= 0, a division by zero) and profile again")


def check_grads_reached(params: list[torch.Tensor]) -> bool:
    """``ProfileError`` if none of ``params`` (the trainable ones) got a gradient from the first step's backward
    (NOTE [ A loss that is not finite ], Rule 5); False (nothing left to check) otherwise."""
    if params and all(p.grad is None for p in params):
        raise ProfileError("no parameter got a gradient from the loss: backward reached none of them, so there is "
                           "nothing to plan; compute the loss from the model's output (is it a new tensor, or "
                           "made from the inputs alone?)")
    return False


def check_materialized(model: torch.nn.Module) -> None:
    """``ModelLoadError`` if a parameter or buffer is on the meta device (has no data to move)."""
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        raise ModelLoadError("the model has parameters or buffers on the meta device (no data); build it on "
                             "the CPU, or materialise it with model.to_empty(device=...) and initialise it")


def check_devices(model: torch.nn.Module, inputs: Inputs, dev: torch.device | None = None) -> torch.device:
    """The one device holding the model's parameters and the input tensors, or ``ModelLoadError``.

    With ``dev`` (where remat will run the step), CPU inputs beside a model already on ``dev`` are
    fine: an earlier pass of remat moved the model there (a profile leaves it on its device), and
    remat moves CPU inputs itself. A second profile of the same model on CUDA, and the memory-safe
    profile's retry after an out-of-memory step, are that case."""
    check_materialized(model)
    param_devices = {p.device for p in model.parameters()}
    if len(param_devices) > 1:
        names = ", ".join(sorted(map(str, param_devices)))
        raise ModelLoadError(f"the model's parameters are on several devices ({names}); remat profiles "
                             f"a model on one device: build it on the CPU and let remat move it")
    (device,) = param_devices
    for t in io_tensors(inputs):
        if t.device != device and not (device == dev and t.device.type == "cpu"):
            raise ModelLoadError(f"example_inputs() returns a tensor on {t.device} but the model is on {device}; "
                                 f"return CPU tensors (remat moves the model and the inputs to the device)")
    return device


__all__ = ["call_model", "called_exit", "check_devices", "check_finite", "check_grads_reached", "check_loss", "check_materialized",
           "check_shape_keywords", "compute_loss", "default_loss", "Inputs", "load_model_file", "loss_arity",
           "LOSS_SIGNATURES", "ModelFile", "SHAPE_KEYWORDS", "TEMPLATE", "user_frames"]
