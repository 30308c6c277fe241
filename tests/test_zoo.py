"""The conformance zoo's fast subset: one model per family, tiny sizes, one budget each.

The full zoo (every model, three budgets) is ``python benchmarks/zoo.py`` (docs/zoo.md). Each
case here profiles a model built from its config class with library defaults, plans at the
budget halfway from the minimum feasible peak to none, applies the plan, and measures: the
measured peak within the budget, the prediction within 2%, every gradient bit for bit.
"""

from __future__ import annotations

import pytest

from benchmarks.zoo import run_model
from benchmarks.zoo_models import BY_NAME, TINY

CI_MODELS = ("llama", "t5", "mixtral", "bart", "bert", "albert", "vit", "resnet", "transformer-encoder",
             "shared-around", "wav2vec2", "llama-lora")
"""One per family: decoders with their default cache (Llama; Mixtral, a mixture-of-experts with
grouped-query attention), encoder-decoders (T5 with its cache, whose replay saved fewer tensors
before NOTE [ Step changes ]; BART), text encoder, weights shared across depth, vision
transformer, CNN, plain PyTorch, a module called around a stack (one decision for the
solvers, NOTE [ Tied calls ]), a speech encoder with layerdrop and SpecAugment on (NOTE [ Worst
step ], NOTE [ Randomness outside torch ]) and a LoRA fine-tune (peft's defaults, the base frozen).
The Mamba is left to the full zoo: its reference scan loops over tokens in Python, 30 s a row here
(tests/test_step_as_run.py covers a step that changes under a dispatch mode)."""


pytestmark = pytest.mark.usefixtures("one_thread", "bytes_only")
"""The gates are bytes and gradients: one thread, as ``python benchmarks/zoo.py`` runs, and the fewest
dispatch-timing rounds (tests/conftest.py)."""


@pytest.mark.parametrize("name", CI_MODELS)
def test_zoo_model_plans_applies_and_measures_as_predicted(name):
    spec = BY_NAME[name]
    if spec.missing():
        pytest.skip(spec.missing())
    (case,) = run_model(spec, fractions=(0.5,), size=TINY)
    assert case.passed, f"{name}: {case.error or '; '.join(case.problems)}"
    assert case.measured_bytes <= case.budget_bytes


RECIPE_CASES = (("bert", "accum4"), ("vit", "bf16"), ("transformer-encoder", "fp16"), ("albert", "clip"),
                ("bart", "accum4+fp16+clip"))
"""The step recipes of issue #17 (benchmarks.zoo.RECIPES), each on one model: the same gates.
transformer-encoder under fp16 is the recipe row nearest the 2% gate (docs/zoo.md)."""


@pytest.mark.parametrize("name, recipe", RECIPE_CASES)
def test_zoo_model_under_a_step_recipe(name, recipe):
    spec = BY_NAME[name]
    if spec.missing():
        pytest.skip(spec.missing())
    (case,) = run_model(spec, fractions=(0.5,), size=TINY, recipe=recipe)
    assert case.recipe == recipe
    assert case.passed, f"{name} under {recipe}: {case.error or '; '.join(case.problems)}"
    assert case.measured_bytes <= case.budget_bytes
