"""remat: optimal activation-checkpoint planning for PyTorch training.

Public API (imported lazily so that ``import solvers.cost_model`` does not import torch)::

    import planner
    prof = planner.profile(model, inputs)             # measure one training step (or planner.load_model_file(path))
    plan = planner.plan(prof, budget="12GB")          # the checkpoint set that fits, at least recompute
    plan.save("plan.json")
    handle = planner.apply_plan(model, "plan.json")   # enforce it on the live model
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "profile": ("planner.profiling", "profile"),
    "plan": ("planner.act.api", "plan"),
    "build_graph": ("planner.model.graph", "build_graph"),
    "simulate": ("solvers.cost_model", "simulate"),
    "apply_plan": ("planner.act.applier", "apply_plan"),
    "remove_plan": ("planner.act.carried", "remove_plan"),
    "verify": ("planner.act.verify", "verify"),
    "Profile": ("planner.model.schema", "Profile"),
    "Plan": ("planner.model.schema", "Plan"),
    "Estimate": ("solvers.cost_model", "Estimate"),
    "parse_bytes": ("planner.sizes", "parse_bytes"),
    "load_model_file": ("planner.profiling.model_file", "load_model_file"),
    "StepSpec": ("planner.spec", "StepSpec"),
    "SolveSpec": ("planner.spec", "SolveSpec"),
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
