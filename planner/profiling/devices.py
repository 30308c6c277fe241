"""Device specs: the accelerators in ``profiles/devices/*.json``, as typed records.

One JSON file per device, its file name the device's ``name``. ``remat devices`` lists them;
``get_device`` resolves a name or alias (case-insensitive), ``match_device`` the name a GPU
reports; ``usable_bytes`` is the default
budget on a device. Data only, no torch import.

Example::

    spec = get_device("h100")
    usable_bytes(spec)                         # the default budget on it
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import BadInput

_PLANNER_DIR = Path(__file__).resolve().parents[1]
# The data in profiles/ sits next to planner/ in a checkout; an installed remat ships it inside
# the package as planner/profiles (pyproject.toml maps it there).
DEVICES_DIR = next(d / "profiles" / "devices" for d in (_PLANNER_DIR, _PLANNER_DIR.parent)
                   if (d / "profiles" / "devices").is_dir())
CALIBRATION_DIR = DEVICES_DIR / "calibration"
"""The calibrations remat ships: one ``<device name>.json`` per calibrated device (``Calibration``).
Read only: a calibration made on this machine goes to ``user_calibration_dir()``."""

CALIBRATION_ENV = "REMAT_CALIBRATION_DIR"
"""Environment variable naming the folder of this machine's calibrations (``user_calibration_dir``)."""


class PeakFlops(BaseModel):
    """Dense peak throughput in FLOP/s per precision; ``None`` where the device has no such unit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fp32: float = Field(description="FLOP/s at fp32 (CUDA cores).")
    tf32: float | None = Field(None, description="FLOP/s at TF32 (tensor cores); None if unsupported.")
    bf16: float | None = Field(None, description="FLOP/s at bf16 (tensor cores); None if unsupported.")
    fp16: float | None = Field(None, description="FLOP/s at fp16 (tensor cores); None if unsupported.")


class DeviceSpec(BaseModel):
    """One accelerator as its datasheet describes it (keys as in the JSON files)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Lower-case id, the file's stem, e.g. 'h100-sxm'.")
    display_name: str
    aliases: list[str] = Field(default_factory=list, description="Other accepted names, lower-case.")
    memory_bytes: int = Field(description="Nominal device memory in bytes.")
    memory_bandwidth_bytes_per_s: float
    compute_capability: str | None = Field(
        None, pattern=r"^[0-9]+\.[0-9]+$", description="CUDA compute capability, e.g. '9.0': the size of cuBLAS's "
                                                       "workspaces (NOTE [ cuBLAS workspaces ]). None: not Hopper's.")
    host_link_bytes_per_s: float | None = Field(
        None, gt=0, description="Bytes/s one way between device and host memory (PCIe, NVLink-C2C), nominal; "
                                "the copy time of offloaded activations (NOTE [ Peak-memory model ], offload). "
                                "None: unknown, and remat plans no offload for the device.")
    host_link_source: str = Field("", description="Where host_link_bytes_per_s comes from.")
    peak_flops: PeakFlops
    source: str = Field(description="Where the figures come from.")
    notes: str = ""


class Calibration(BaseModel):
    """The roofline's efficiency constants for one device, fitted on a real step (NOTE [ Roofline ])."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(description="The device spec's name.")
    matmul_efficiency: float = Field(gt=0, le=1, description="Share of peak FLOP/s ops with FLOPs reach.")
    bandwidth_efficiency: float = Field(gt=0, le=1, description="Share of memory bandwidth the other ops reach.")
    measured_on: str = Field(description="torch.cuda.get_device_name() of the GPU that measured it.")
    torch_version: str
    created_at: str = Field(description="ISO 8601 UTC.")
    method: str = Field(description="How the constants were fitted, and on which models.")
    modelled_over_measured_before: float = Field(description="Modelled / measured time of the fitted units "
                                                             "with the constants used before this fit.")


def user_calibration_dir() -> Path:
    """Where calibrations made on this machine are written (benchmarks/gpu_check.py) and read first:
    ``$REMAT_CALIBRATION_DIR``, else ``$XDG_CONFIG_HOME/remat/calibration`` (``~/.config/remat/calibration``).
    Never inside the installed package, which may be read-only and is replaced by an upgrade."""
    if os.environ.get(CALIBRATION_ENV):
        return Path(os.environ[CALIBRATION_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "remat" / "calibration"


def calibration_path(spec: DeviceSpec, directory: str | Path | None = None) -> Path:
    """The calibration file of ``spec`` that ``load_calibration`` reads: in ``directory`` when given,
    else this machine's (``user_calibration_dir``) when it has one, else the shipped one."""
    if directory is not None:
        return Path(directory) / f"{spec.name}.json"
    mine = user_calibration_dir() / f"{spec.name}.json"
    return mine if mine.exists() else CALIBRATION_DIR / f"{spec.name}.json"


def calibration_source(path: Path) -> str:
    """How a profile names the calibration file ``path``: shipped ones by their place in the checkout."""
    return f"profiles/devices/calibration/{path.name}" if path.parent == CALIBRATION_DIR else str(path)


def load_calibration(spec: DeviceSpec, directory: str | Path | None = None) -> Calibration | None:
    """The calibration of ``spec`` (``calibration_path``), or None when it has none."""
    path = calibration_path(spec, directory)
    if not path.exists():
        return None
    try:
        cal = Calibration.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, ValidationError) as e:
        raise BadInput(f"calibration file {path} is not a valid calibration ({type(e).__name__}); "
                       f"re-create it with benchmarks/gpu_check.py on the GPU, or remove it") from None
    if cal.device != spec.name:
        raise BadInput(f"calibration file {path} is for device {cal.device!r}, not {spec.name!r}; rename or remove it")
    return cal


# NOTE [ Usable memory ]
# A budget is compared with the peak of *allocated* tensor bytes (torch.cuda.max_memory_allocated),
# but the card's nominal memory also holds what no tensor accounts for:
#   - the CUDA context: driver state, loaded kernel images and the cuBLAS/cuDNN handles and
#     workspaces, 500-800 MiB on recent GPUs and drivers (more with many kernels loaded, e.g.
#     NCCL for distributed runs): CONTEXT_RESERVE_BYTES, a flat 1 GiB;
#   - the caching allocator's slack: blocks reserved but not allocated (rounding to 2 MiB
#     segments, fragmentation between differently sized tensors), typically a few percent
#     of what is in use: FRAGMENTATION_FRACTION of the memory, 5%.
# Both are assumptions; pass --budget to override. usable = memory - 1 GiB - 5% of memory:
# 75 GiB of an 80 GiB H100, 14.2 GiB of a 16 GiB T4.

CONTEXT_RESERVE_BYTES = 1 << 30
"""CUDA context, kernel images and library workspaces (see NOTE [ Usable memory ])."""

FRAGMENTATION_FRACTION = 0.05
"""Caching-allocator slack, as a share of the device memory (see NOTE [ Usable memory ])."""


HOST_MEMORY_FRACTION = 0.8
"""Default host budget for offloaded activations: this share of the host's available memory."""


def available_host_bytes() -> int | None:
    """This machine's available memory (MemAvailable of /proc/meminfo, Linux), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reserve_bytes(spec: DeviceSpec) -> int:
    """Memory of ``spec`` not available to tensors (see NOTE [ Usable memory ])."""
    return CONTEXT_RESERVE_BYTES + int(spec.memory_bytes * FRAGMENTATION_FRACTION)


def usable_bytes(spec: DeviceSpec) -> int:
    """The default budget on ``spec``: its memory less ``reserve_bytes`` (see NOTE [ Usable memory ])."""
    return spec.memory_bytes - reserve_bytes(spec)


def load_devices(directory: str | Path | None = None) -> list[DeviceSpec]:
    """All device specs in ``directory`` (default ``profiles/devices``), sorted by name.

    Raises ``BadInput`` naming the file when one is not valid JSON or lacks a key.
    """
    folder = Path(directory) if directory is not None else DEVICES_DIR
    specs = [_load_one(p) for p in sorted(folder.glob("*.json"))]
    return sorted(specs, key=lambda s: s.name)


def get_device(name: str, *, directory: str | Path | None = None) -> DeviceSpec:
    """The spec whose name or alias is ``name`` (case-insensitive, surrounding spaces ignored)."""
    specs = load_devices(directory)
    wanted = name.strip().lower()
    for spec in specs:
        if wanted == spec.name or wanted in spec.aliases:
            return spec
    valid = ", ".join(s.name for s in specs) or "(none found in profiles/devices)"
    raise BadInput(f"unknown device {name!r}; choose one of: {valid} (or an alias, see `remat devices`)")


def match_device(gpu_name: str, *, directory: str | Path | None = None) -> DeviceSpec | None:
    """The spec for a GPU as ``torch.cuda.get_device_name`` names it, or None: the spec one of whose
    names (its name or an alias, split at '-') has every word in ``gpu_name``, the most words matched
    winning ("NVIDIA A100-SXM4-40GB" is a100-40gb by its alias a100-sxm4-40gb, not a100-80gb by 'a100')."""
    words = set(gpu_name.lower().replace("-", " ").split())

    def matched(spec: DeviceSpec) -> int:
        return max((len(w) for w in (set(n.split("-")) for n in (spec.name, *spec.aliases)) if w <= words),
                   default=0)

    best = max(load_devices(directory), key=matched, default=None)
    return best if best is not None and matched(best) else None


def _load_one(path: Path) -> DeviceSpec:
    try:
        return DeviceSpec.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise BadInput(f"device spec {path} is not valid JSON (line {e.lineno}: {e.msg}); "
                       f"fix or remove it") from None
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise BadInput(f"device spec {path} is malformed at {loc or '<top>'}: {first['msg']}; "
                       f"fix or remove it") from None


__all__ = ["CALIBRATION_DIR", "CALIBRATION_ENV", "CONTEXT_RESERVE_BYTES", "Calibration", "DEVICES_DIR",
           "DeviceSpec", "FRAGMENTATION_FRACTION", "PeakFlops", "calibration_path", "calibration_source",
           "get_device", "load_calibration", "load_devices", "match_device", "reserve_bytes", "usable_bytes",
           "user_calibration_dir"]
