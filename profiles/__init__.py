"""Versioned data shipped with remat: device specs (``devices/*.json``) and reference
model profiles (``models/*.json``), so solvers and benchmarks run without a GPU."""

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent
DEVICES_DIR = PROFILES_DIR / "devices"
MODELS_DIR = PROFILES_DIR / "models"
