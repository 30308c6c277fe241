"""What every number in a profile or plan file may be (NOTE [ Numbers in files ]), the base of the file
models, and loading a versioned file with one-line errors. None of this imports torch.

Example::

    class Record(FileModel):
        bytes: Bytes
        forward_ms: Ms
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from planner.errors import PlanFileError
from planner.files import as_path, device_kind
from planner.sizes import MAX_SIZE_BYTES


class FileModel(BaseModel):
    """The base of every file model: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", frozen=False)


# NOTE [ Numbers in files ]
#
# A profile or plan file may be hand-edited, truncated by hand, or written by another tool, and a
# plan drives a training job: every number is checked where it is loaded, so that an impossible
# figure (a NaN time, a negative size, an absurd world size) is one line naming its field rather
# than a plan labelled optimal with "recompute nan ms".
# Rule 1. Sizes are integers in [0, MAX_BYTES]; times, FLOPs and seconds are finite and >= 0;
#   sequence numbers, indices and counts are integers in [0, MAX_COUNT]; thread counts >= 1.
# Rule 2. Figures that must agree with their neighbours are checked together (``check_records``,
#   ``_check_plan``): a unit ends after it starts, records point at tensors and units that exist,
#   a plan's predicted peak is its breakdown's sum and fits its budget less the headroom.
# Rule 3. An error names the path into the file (``units.3.forward_ms``) and the value found.

MAX_BYTES = MAX_SIZE_BYTES
"""1 EiB: above any device or host memory; a larger size in a file is an error."""
MAX_WORLD_SIZE = 2**20
"""Ranks: above any data-parallel job run so far; a larger world size in a plan is an error."""

Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Ms = Annotated[float, Field(ge=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
MAX_COUNT = 2**53
"""Sequence numbers, ids and counts: a step records far fewer events; a larger one in a file is an error."""
Seq = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
MAX_GRAD_ACCUM = 2**20
"""Micro-batches per optimizer step: a recipe with more is an error."""
MAX_THREADS = 4096
"""torch intra-op threads: above any machine's cores; more in a file or an option is an error."""
Threads = Annotated[int, Field(ge=1, le=MAX_THREADS)]


def bad_field(path: str, message: str) -> PydanticCustomError:
    """A consistency error for ``load_versioned`` to word: ``path`` into the file, then what is wrong."""
    return PydanticCustomError("remat_consistency", "{path}: {message}", {"path": path, "message": message})


def now_iso() -> str:
    """Now, UTC, to the second (ISO 8601): the stamp profiles and plans carry."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def read_document(path: str | Path, what: str) -> Any:
    """The JSON in the file ``path``, read once, or ``PlanFileError`` naming what is wrong (``what``: 'profile'
    or 'plan', the command that writes it, or ``EITHER`` where both are read: missing, a folder or a device, empty,
    or not JSON. Under ``EITHER`` a message names the kind the file's text begins with (Rule 6 of NOTE [ Files
    that are not remat's JSON ])."""
    path = as_path(path, f"the path of a {what} file")
    try:
        if not path.exists():
            raise PlanFileError(f"{what} file {path} does not exist; check the path")
        if path.is_dir():
            raise PlanFileError(f"{path} is a directory, not a {what} file")
        if device := device_kind(path):
            raise PlanFileError(f"{path} is {device}, not a {what} file; pass the file {_by(what)} wrote")
        data = path.read_bytes()
    except OSError as e:  # unreadable, a name too long (JSON text given as a path), an I/O error
        raise _unreadable(path, what, e) from None
    text = _text_of(data, path, what)
    what = _kind_begun(text) if what == EITHER else what
    if not text.strip():
        raise PlanFileError(f"{what} file {path} is empty; re-create it with {_by(what, ' ...')}")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _KeyTwice as e:  # Rule 5 of NOTE [ Files that are not remat's JSON ]
        raise PlanFileError(f"{what} file {path} has the key {e.args[0]!r} twice in one object, and JSON readers "
                            f"disagree on which counts (Python's takes the last); keep one, or re-create the file "
                            f"with {_by(what, ' ...')}") from None
    except json.JSONDecodeError as e:
        if e.pos == len(text) - len(text.lstrip()):  # Rule 3 of NOTE [ Files that are not remat's JSON ]
            begins = text.lstrip().splitlines()[0][:30]
            raise PlanFileError(f"{what} file {path} is not valid JSON: it begins {begins!r}, not with '{{'; pass "
                                f"a file written by {_by(what)}") from None
        raise PlanFileError(
            f"{what} file {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            f"it may be truncated: re-create it with {_by(what, ' ...')}"
        ) from None
    except (RecursionError, ValueError) as e:  # Rule 2 of NOTE [ Files that are not remat's JSON ]
        why = "nested too deep" if isinstance(e, RecursionError) else "a number with too many digits"
        raise PlanFileError(f"{what} file {path} is JSON that no remat writes ({why}); pass the file "
                            f"{_by(what)} wrote, or re-create it") from None


EITHER = "plan or profile"
"""``read_document``'s ``what`` where a plan and a profile are both read (``remat show``)."""

_KIND_FIRST = re.compile(r'\A\s*\{\s*"kind"\s*:\s*"remat-(plan|profile)"')


def _kind_begun(text: str) -> str:
    """'plan' or 'profile' when ``text`` begins as remat writes that kind (its first key), else ``EITHER``."""
    found = _KIND_FIRST.match(text)
    return found.group(1) if found else EITHER


def _by(what: str, tail: str = "") -> str:
    """The command that writes a ``what`` file, quoted: '`remat plan`', or both under ``EITHER``."""
    return " or ".join(f"`remat {w}{tail}`" for w in what.split(" or "))


class _KeyTwice(Exception):
    """A JSON object with a key twice; ``args[0]``: the key."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s object hook: the object, or ``_KeyTwice`` (Rule 5 of NOTE [ Files that are not remat's JSON ])."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _KeyTwice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


# NOTE [ Files that are not remat's JSON ]
#
# Rule 1. An input file is read as bytes and decoded as UTF-8; a UTF-8 byte-order mark (which some
#   Windows editors write) is dropped. Bytes that are not UTF-8, or a NUL byte, mean the file is no
#   text at all (compressed, binary, UTF-16): one line says so, not "it may be truncated".
# Rule 2. JSON that Python's decoder refuses for its own limits (arrays nested thousands deep: a
#   RecursionError; an integer of more than 4,300 digits: a ValueError) is one line too.
# Rule 3. A text file that is not JSON from its first character (a model file, a YAML config) is
#   said to begin with what it begins with; "it may be truncated" only of JSON that stops short.
# Rule 4. An input the system cannot read (permission denied, a name too long: JSON text passed as
#   a path to ``Plan.load``, an I/O error) is one line with the reason, not an internal OSError.
# Rule 5. An object with a key twice (``"budget_bytes": 5, "budget_bytes": 1073741824``, as a hand edit or a
#   merge leaves one) is refused naming the key: JSON readers disagree on which one counts, and Python's took the
#   last in silence (round 18 probe: `remat show` printed the second budget, exit 0).
# Rule 6. Where a plan and a profile are both read (``remat show``), the kind is not known before the file is read:
#   a message names the kind the file's text begins with (remat writes ``"kind"`` first), or "plan or profile"
#   when it cannot be told (unreadable, not text, a folder). `remat show` called a truncated profile a "plan file"
#   whose fix was `remat plan ...` (round 18 probe).
# Why: `remat plan --profile profile.json.gz` and `remat verify model.py model.py` said the file
# "may be truncated", a profile saved from Notepad with a BOM was refused, and a 100,000-deep
# array ended as "internal error: RecursionError".


def _unreadable(path: Path, what: str, e: OSError) -> PlanFileError:
    """Rule 4 of NOTE [ Files that are not remat's JSON ]."""
    given = str(path)
    if given.lstrip().startswith("{"):
        return PlanFileError(f"expected the path of a {what} file, got JSON text; to read text, call "
                             f"{what.capitalize()}.model_validate_json(text)")
    shown = given if len(given) <= 80 else given[:60] + "..."
    return PlanFileError(f"cannot read {what} file {shown}: {e.strerror or e}; pass the path of the file "
                         f"{_by(what)} wrote")


def _text_of(data: bytes, path: Path, what: str) -> str:
    """``data`` decoded as UTF-8 without its byte-order mark, or ``PlanFileError`` (Rule 1 above)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        head = data[:2]
        kind = ("a gzip file" if head == b"\x1f\x8b" else "UTF-16 text" if head in (b"\xff\xfe", b"\xfe\xff")
                else "a binary file")
        raise PlanFileError(f"{what} file {path} is not UTF-8 text (it looks like {kind}); pass the JSON file "
                            f"{_by(what)} wrote (uncompressed)")
    return text


def load_versioned(cls: Any, path: str | Path, kind: str, version: int, what: str, document: Any = None) -> Any:
    """``cls`` validated from the JSON file ``path`` of ``kind`` (at most schema ``version``), or ``PlanFileError``
    naming what is wrong and how to fix it (``what``: 'profile' or 'plan', the command that writes it).
    ``document``: the file's JSON when ``read_document`` read it already (a pipe, ``<(cat plan.json)``, reads once)."""
    path = as_path(path, f"a {cls.__name__} or the path of a {what} file")
    data = read_document(path, what) if document is None else document
    if not isinstance(data, dict) or data.get("kind") != kind:
        found = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(
            f"{path} is JSON but not a remat {what} (kind={found!r}, expected {kind!r}); "
            f"pass a file written by `remat {what}`"
        )
    sv = data.get("schema_version")
    if not isinstance(sv, int) or isinstance(sv, bool) or sv < 1:  # JSON true is no version
        raise PlanFileError(f"{what} file {path} has schema_version {json.dumps(sv)}, which no remat writes (an "
                            f"integer from 1 to {version}); re-create it with `remat {what} ...`")
    if sv > version:
        raise PlanFileError(
            f"{what} file {path} has schema_version {sv!r}, this remat reads version {version}; "
            f"upgrade remat (pip install -U remat) or re-create the file"
        )
    control = control_text(data)
    if control is not None:
        raise PlanFileError(f"{what} file {path}: {control[0] or '<top>'}: text with the control character "
                            f"{control[1]!r}, which remat never writes and `remat show` would send to your terminal; "
                            f"re-create it with `remat {what} ...`")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise PlanFileError(f"{what} file {path}: {field_error(e)}; re-create it with `remat {what} ...`") from None


# NOTE [ Text in files ]
#
# `remat show` prints a file's text (module names, the model class, the solver's detail, the device's name) to the
# terminal, and a plan from someone else is meant to be safe to show (docs/cli.md, "Trust"). A control character
# in that text is a terminal command: ESC [2J cleared the screen, ESC ]0; set the window title (round 18 probe;
# printed as read, exit 0). Rule 1. A string anywhere in a plan or profile file (a key too) that holds a C0
# control character other than newline and tab, DEL, or a C1 control character is refused, naming its path and
# the character, before the file is validated. Rule 2. Newline and tab stay: they are text, and an error
# message remat recorded may hold them. Rule 3. A file's name is text remat prints too (`wrote NAME`, `error: plan
# file NAME ...`): a name holding ESC [2J cleared the screen in `remat show`'s error, ESC ]0; set the window title
# in `wrote` (round 19 probe, `remat show *.json` in a folder from someone else). remat's own lines (``error_line``,
# ``plain`` in ``planner/cli/render.py``) write such characters as escapes, ``\x1b[2J``; newline and tab stay (a
# message's hint and the user's traceback lines follow on their own lines).

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` with each control character but newline and tab written as its escape (``\x1b``): Rule 3 of
    NOTE [ Text in files ], for remat's own lines, which name files by the names the user or a folder gave."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def control_text(data: Any, where: str = "") -> tuple[str, str] | None:
    """``(path into the file, character)`` of the first string in ``data`` that holds a control character
    (NOTE [ Text in files ]), or None."""
    stack = [(where, data)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, str):
            found = _CONTROL.search(item)
            if found:
                return at, found.group()
        elif isinstance(item, dict):
            stack.extend((f"{at}.{k}" if at else str(k), k) for k in reversed(item))
            stack.extend((f"{at}.{k}" if at else str(k), v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{at}.{i}" if at else str(i), v) for i, v in reversed(list(enumerate(item))))
    return None


def field_error(e: ValidationError) -> str:
    """The first error as ``path.into.file: what is wrong (got VALUE)`` (Rule 3 of NOTE [ Numbers in files ])."""
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    if first["type"] == "remat_consistency":
        return first["msg"] if not loc else f"{loc}.{first['msg']}"
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) or first["type"] == "missing" else f" (got {got!r})"
    return f"{loc or '<top>'}: {first['msg'][:1].lower()}{first['msg'][1:]}{shown}"


__all__ = ["bad_field", "Bytes", "Count", "control_text", "EITHER", "field_error", "FileModel", "load_versioned", "MAX_BYTES",
           "MAX_COUNT", "MAX_GRAD_ACCUM", "MAX_THREADS", "MAX_WORLD_SIZE", "Ms", "NonNegFloat", "now_iso", "read_document", "Seq", "terminal_safe", "Threads"]
