"""Issue 17's cases: a plan made for the step users run, measured under that step.

Hugging Face Llama (8 layers, hidden 256, batch 4 x 256, random weights, built from its config),
``--optimizer none``, on the CPU. For each recipe: profile, plan halfway between the lowest
feasible peak and the peak without checkpointing, then ``verify`` (train with and without the
plan, measure the peak). Prints budget, predicted and measured peak, error and whether it fits.

    python benchmarks/recipe_cases.py                     # the plain step, accumulation 2, bf16
    python benchmarks/recipe_cases.py --recipes "grad_accum=4,amp=fp16,clip_grad_norm=1"
    python benchmarks/recipe_cases.py --no-cache-off      # the model exactly as its config builds it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from planner.act.api import budget_with_headroom, graph_for, headroom_for, min_feasible_bytes, plan_from_profile  # noqa: E402
from planner.act.verify import verify  # noqa: E402
from planner.model.schema import Recipe  # noqa: E402
from planner.profiling import profile  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402

DEFAULT_RECIPES = ("", "grad_accum=2", "amp=bf16")


def build_model(*, cache_off: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    extra = {"use_cache": False} if cache_off else {}
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **extra)
    return LlamaForCausalLM(config)


def example_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 2048, (4, 256), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def parse_recipe(text: str) -> Recipe:
    """'grad_accum=4,amp=bf16' -> Recipe; '' is the plain loop."""
    fields = dict(kv.split("=", 1) for kv in text.split(",") if kv)
    return Recipe.model_validate(fields)


def run_case(recipe: Recipe, *, cache_off: bool) -> dict:
    model, batch = build_model(cache_off=cache_off), example_inputs()
    prof = profile(model, batch, device="cpu", optimizer="none", recipe=recipe, steps=1)
    g = graph_for(prof)
    budget = budget_with_headroom((simulate(g, []).peak_bytes + min_feasible_bytes(g)) // 2, headroom_for(prof))
    plan = plan_from_profile(prof, budget)
    rep = verify(model, plan, inputs=batch, device="cpu", steps=1)
    error = (rep.predicted_peak_bytes - rep.measured_peak_bytes) / rep.measured_peak_bytes
    return dict(recipe=recipe.describe(), budget=budget, predicted=rep.predicted_peak_bytes,
                measured=rep.measured_peak_bytes, error=error, fits=rep.measured_peak_bytes <= budget,
                grad_diff=rep.max_grad_diff, checkpoints=len(plan.checkpoints))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="*", default=list(DEFAULT_RECIPES),
                    help="recipes as field=value lists ('' = the plain loop)")
    ap.add_argument("--cache-off", action=argparse.BooleanOptionalAction, default=True,
                    help="build with use_cache=False (as the issue did); --no-cache-off keeps the config's default")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'recipe':<86} {'budget':>12} {'predicted':>12} {'measured':>12} {'error':>7} fits grad diff")
    for text in args.recipes:
        r = run_case(parse_recipe(text), cache_off=args.cache_off)
        print(f"{r['recipe']:<86} {r['budget']:>12,} {r['predicted']:>12,} {r['measured']:>12,} "
              f"{r['error']:>+7.2%} {'yes' if r['fits'] else 'NO':>4} {r['grad_diff']:g}", flush=True)


if __name__ == "__main__":
    main()
