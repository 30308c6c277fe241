"""Byte sizes: parsing user budgets and printing sizes.

GB/TB/MB/KB are read as binary units (GiB...), as GPU memory is sold and as PyTorch
reports it; KiB/MiB/GiB/TiB are accepted too. Plain integers are bytes.

Example::

    parse_bytes("12GB")                        # 12884901888 (GB is read as GiB)
    format_bytes(150 * 2**20)                  # '150.00 MiB'
"""

from __future__ import annotations

import math
import re

from planner.errors import BadInput

_MULTIPLIERS = {
    "": 1, "b": 1,
    "k": 2**10, "kb": 2**10, "kib": 2**10,
    "m": 2**20, "mb": 2**20, "mib": 2**20,
    "g": 2**30, "gb": 2**30, "gib": 2**30,
    "t": 2**40, "tb": 2**40, "tib": 2**40,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,  # Kubernetes' spelling
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_HINT = "use bytes or a number with a unit, e.g. 12GB, 12GiB, 800MiB, 1.5e9"

# NOTE [ Budgets that read as something else ]
#
# Rule 1. Units are case-insensitive (``12gb`` is 12 GiB), except a capital prefix before a small
#   ``b``: ``8Gb``, ``512Mb`` are how bits are written (memory chips, link speeds), an eighth of the
#   bytes. Read as bytes they would plan for 8 times the memory meant, or the user meant bytes and
#   typed one letter wrong: either way the fix is one keystroke, so it is refused, naming both readings.
# Rule 2. Forms that are numbers elsewhere are refused with their own fix, not only the list of
#   accepted forms: a decimal comma (``1,5GB``), digit separators (``1_000MB``, ``1,000MB``), a share
#   (``80%``: remat reads no device's size from a budget; ``--target NAME`` gives its usable memory).
# Rule 3. ``Ki``, ``Mi``, ``Gi``, ``Ti`` (Kubernetes' spelling of the binary units) are read as KiB, MiB, GiB, TiB.
# Rule 4. A float NaN given in Python (``budget=float("nan")``, a budget computed from a failed measurement) is said
#   to be no number; it was "a memory budget must be positive" (round 19 probe).
# Every message still ends with the accepted forms.
# Why: round 17 probes: ``-b 8Gb`` planned for 8 GiB; ``1,5GB``, ``1_000MB`` and ``80%`` got only the
# generic line.

_BITS_RE = re.compile(r"^\s*([0-9.eE+-]+)\s*([KMGT])b\s*$")


def _misread(raw: str) -> str | None:
    """Why ``raw``, which the grammar refuses or would misread, is not a budget, with its fix
    (NOTE [ Budgets that read as something else ]); None when it is no such form."""
    stripped = raw.strip()
    bits = _BITS_RE.match(raw)
    if bits:
        number, prefix = bits.groups()  # not the text itself: a newline may stand between them
        return (f"'{prefix}b' is {prefix}bit, an eighth of a {prefix}B; write {number}{prefix}B for bytes "
                f"(units are binary: {prefix}B = {prefix}iB)")
    if stripped.endswith("%"):
        return ("a share of the device is not a budget remat can read; give bytes (e.g. 64GB), or --target NAME "
                "to plan for that device's usable memory")
    if re.fullmatch(r"[0-9]+,[0-9]{1,2} ?[A-Za-z]*", stripped):
        return f"write the decimal point as '.', e.g. {stripped.replace(',', '.')}"
    if re.fullmatch(r"[0-9]{1,3}([,_][0-9]{3})+(\.[0-9]+)? ?[A-Za-z]*", stripped):
        return f"write the number without separators, e.g. {stripped.replace(',', '').replace('_', '')}"
    if "_" in stripped:  # the input itself is not echoed: it may hold any character, a newline too
        return "write the number without separators ('_' or ',')"
    return None


def parse_bytes(text: str | int | float) -> int:
    """Parse a memory size such as ``12GB``, ``12 GiB``, ``800MiB`` or ``1e9`` into bytes.

    Raises ``BadInput`` naming the accepted forms for anything else, including zero,
    negative sizes and unknown units.
    """
    if isinstance(text, bool):
        raise BadInput(f"invalid size {text!r}: {_HINT}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        raw = str(text)
        if raw.strip().startswith("-"):
            raise BadInput(f"invalid size {raw!r}: a memory budget must be positive; {_HINT}")
        m = _BUDGET_RE.match(raw)
        why = _misread(raw)
        if why or not m:
            raise BadInput(f"invalid size {raw!r}: {why + '; ' if why else ''}{_HINT}")
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit not in _MULTIPLIERS:
            raise BadInput(f"invalid size {raw!r}: unknown unit {m.group(2)!r}; {_HINT}")
    if math.isnan(value):  # Rule 4 of NOTE [ Budgets that read as something else ]
        raise BadInput(f"invalid size {text!r}: not a number (NaN); {_HINT}")
    if math.isinf(value):  # 1e400 reads as infinity: a size, only far too large
        raise BadInput(f"invalid size {text!r}: more than 1 EiB, above any device's memory; {_HINT}")
    if not math.isfinite(value) or value <= 0:
        raise BadInput(f"invalid size {text!r}: a memory budget must be positive; {_HINT}")
    product = value * _MULTIPLIERS[unit]
    if not math.isfinite(product) or product > MAX_SIZE_BYTES:
        raise BadInput(f"invalid size {text!r}: more than 1 EiB, above any device's memory; {_HINT}")
    n = int(round(product))
    if n <= 0:
        raise BadInput(f"invalid size {text!r}: it rounds to 0 bytes; {_HINT}")
    if n > MAX_SIZE_BYTES:
        raise BadInput(f"invalid size {text!r}: more than 1 EiB, above any device's memory; {_HINT}")
    return n


MAX_SIZE_BYTES = 2**60
"""1 EiB: the largest size remat accepts, in a budget or a file (NOTE [ Numbers in files ])."""


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: ``1.50 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


__all__ = ["format_bytes", "MAX_SIZE_BYTES", "parse_bytes"]
