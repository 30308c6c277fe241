"""Device spec files in profiles/devices/ are well-formed data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

DEVICES_DIR = Path(__file__).resolve().parent.parent / "profiles" / "devices"
SPEC_FILES = sorted(DEVICES_DIR.glob("*.json"))

KEYS = {
    "name",
    "display_name",
    "aliases",
    "memory_bytes",
    "memory_bandwidth_bytes_per_s",
    "compute_capability",
    "host_link_bytes_per_s",
    "host_link_source",
    "peak_flops",
    "source",
    "notes",
}
PRECISIONS = {"fp32", "tf32", "bf16", "fp16"}
EXPECTED = {
    "h100-sxm", "h200", "a100-80gb", "a100-40gb", "l4", "l40s",
    "rtx-4090", "rtx-3090", "rtx-3060-12gb", "t4", "v100",
}


def _load(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _positive_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def test_expected_devices_present():
    assert {p.stem for p in SPEC_FILES} >= EXPECTED


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_spec_is_well_formed(path: Path):
    spec = _load(path)
    assert isinstance(spec, dict)
    assert set(spec) == KEYS, f"keys differ: {sorted(set(spec) ^ KEYS)}"

    assert spec["name"] == path.stem
    assert spec["name"] == spec["name"].lower() and " " not in spec["name"]
    for key in ("display_name", "source", "notes", "host_link_source"):
        assert isinstance(spec[key], str) and spec[key].strip(), key

    aliases = spec["aliases"]
    assert isinstance(aliases, list)
    assert all(isinstance(a, str) and a and a == a.lower() and " " not in a for a in aliases)
    assert len(set(aliases)) == len(aliases)
    assert spec["name"] not in aliases

    assert isinstance(spec["memory_bytes"], int) and not isinstance(spec["memory_bytes"], bool)
    assert spec["memory_bytes"] > 0
    # Between 4 GiB and 1 TiB: catches GB-vs-bytes unit mistakes.
    assert 4 * 2**30 <= spec["memory_bytes"] <= 2**40

    bandwidth = spec["memory_bandwidth_bytes_per_s"]
    assert _positive_number(bandwidth)
    assert 1e11 <= bandwidth <= 1e14, "bandwidth must be in bytes/s"

    major, minor = spec["compute_capability"].split(".")  # the cuBLAS workspace's size (NOTE [ cuBLAS workspaces ])
    assert 7 <= int(major) <= 12 and minor.isdigit()

    link = spec["host_link_bytes_per_s"]
    assert _positive_number(link)
    assert 1e10 <= link <= 1e12, "host link must be in bytes/s, one direction"
    assert link < bandwidth, "the host link is slower than device memory"

    flops = spec["peak_flops"]
    assert isinstance(flops, dict) and set(flops) == PRECISIONS
    assert _positive_number(flops["fp32"]) and _positive_number(flops["fp16"])
    for precision, value in flops.items():
        assert value is None or _positive_number(value), precision
        if value is not None:
            assert 1e12 <= value <= 1e16, f"{precision} must be in FLOP/s"
            assert value >= flops["fp32"], f"{precision} slower than fp32"


def test_names_and_aliases_unique():
    seen: dict[str, str] = {}
    for path in SPEC_FILES:
        spec = _load(path)
        for label in [spec["name"], *spec["aliases"]]:
            assert label not in seen, f"{label!r} used by both {seen[label]} and {path.name}"
            seen[label] = path.name


def test_display_names_unique():
    names = [_load(p)["display_name"] for p in SPEC_FILES]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(("reported", "spec"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("Tesla T4", "t4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"),
    ("AMD Instinct MI300X", None), ("", None),
])
def test_a_gpu_is_matched_by_the_name_it_reports(reported: str, spec: str | None):
    from planner.profiling.devices import match_device

    found = match_device(reported)
    assert (found.name if found else None) == spec  # a 40 GB A100 is not the 80 GB one its bare 'a100' names
