"""Every model file in examples/ builds, runs one forward+backward, and trains all parameters.

A model file defines ``build_model()``, ``example_inputs()`` and optionally
``loss_fn(output)``. The loss rule: ``loss_fn(output)`` if defined, else
``output.loss`` when present, else the sum of the floating-point outputs.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def _model_files() -> list[Path]:
    files = []
    for path in sorted(EXAMPLES_DIR.glob("*.py")):
        if path.name.startswith("_"):
            continue
        text = path.read_text(encoding="utf-8")
        # META_ONLY files (examples/llama7b.py: 27 GB on the CPU) run on fake tensors, in tests/test_meta.py
        if "def build_model" in text and "\nMETA_ONLY = True" not in text:
            files.append(path)
    return files


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"remat_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(model: torch.nn.Module, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _floating_leaves(obj):
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, dict) or hasattr(obj, "items"):
        for value in obj.values():
            yield from _floating_leaves(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _floating_leaves(value)


def _loss(module, output) -> torch.Tensor:
    if hasattr(module, "loss_fn"):
        return module.loss_fn(output)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = list(_floating_leaves(output))
    assert leaves, "output has no floating-point tensors to sum"
    return sum(t.float().sum() for t in leaves)


MODEL_FILES = _model_files()


def test_examples_exist():
    names = {p.stem for p in MODEL_FILES}
    assert {"transformer", "gpt2", "resnet", "unet", "t5", "llama"} <= names


@pytest.mark.parametrize("path", MODEL_FILES, ids=[p.stem for p in MODEL_FILES])
def test_example_forward_backward(path: Path):
    module = _load(path)
    assert (module.__doc__ or "").strip(), f"{path.name} needs a module docstring"
    assert callable(getattr(module, "example_inputs", None))

    torch.manual_seed(0)
    model = module.build_model()
    assert isinstance(model, torch.nn.Module)
    model.train()
    inputs = module.example_inputs()
    assert isinstance(inputs, (torch.Tensor, tuple, list, dict))

    loss = _loss(module, _call(model, inputs))
    assert isinstance(loss, torch.Tensor)
    assert loss.dim() == 0, f"loss must be a scalar, got shape {tuple(loss.shape)}"
    assert math.isfinite(loss.item())
    loss.backward()

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert params, "model has no trainable parameters"
    missing = [n for n, p in params if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    nonfinite = [n for n, p in params if not torch.isfinite(p.grad).all()]
    assert not nonfinite, f"parameters with non-finite gradients: {nonfinite}"


@pytest.mark.parametrize("path", MODEL_FILES, ids=[p.stem for p in MODEL_FILES])
def test_example_is_deterministic(path: Path):
    module = _load(path)
    a, b = module.build_model().state_dict(), module.build_model().state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    x, y = module.example_inputs(), module.example_inputs()
    flat_x = list(_all_tensors(x))
    flat_y = list(_all_tensors(y))
    assert len(flat_x) == len(flat_y) and flat_x
    assert all(torch.equal(s, t) for s, t in zip(flat_x, flat_y))


def _all_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj):
            yield from _all_tensors(obj[key])
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _all_tensors(value)
