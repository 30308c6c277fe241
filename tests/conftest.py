"""Shared test configuration and fixtures: hypothesis profiles, the CLI in-process (``invoke``),
and the synthetic chain most CLI tests plan on (``profile_path``) with its lowest feasible peak."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import settings
from typer.testing import CliRunner

from cli import app
from planner.model.synthetic import random_chain, synthetic_profile

# CI runs a fixed set of examples (a red CI must be reproducible, not a lucky draw); a developer's
# run draws new ones, so the property tests keep searching. HYPOTHESIS_PROFILE=ci reproduces CI.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))

CHAIN_MIN_FEASIBLE_BYTES = 7197536
"""The cost model's lowest feasible peak of ``profile_path``'s chain (no headroom)."""

_runner = CliRunner()


def invoke(*args: str | Path):
    """``remat ARGS...`` through typer's CliRunner: ``.exit_code``, ``.stdout``, ``.stderr``, ``.output``."""
    return _runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    """An 8-block synthetic chain saved as a profile: fits 10MB with one checkpoint, needs at least
    ``CHAIN_MIN_FEASIBLE_BYTES`` without headroom."""
    path = tmp_path / "profile.json"
    synthetic_profile(random_chain(random.Random(0), 8)).save(path)
    return path
