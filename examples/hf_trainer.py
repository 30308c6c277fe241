"""Train a tiny Hugging Face GPT-2 with ``Trainer`` and a remat plan: the plan is one callback.

    python examples/hf_trainer.py --budget 10MB --steps 3           # plan here, then train with it
    remat plan examples/hf_trainer.py --budget 10MB --clip-grad-norm 1 --fused -o plan.json  # or: a model file ...
    python examples/hf_trainer.py --write-config cfg               # ... or plan its config.json:
    remat plan --hf cfg --batch 4 --seq-len 64 --budget 10MB --clip-grad-norm 1 --fused -o plan.json
    python examples/hf_trainer.py --plan plan.json --steps 3       # train with the plan file
    python examples/hf_trainer.py --steps 3                        # no plan: the baseline

The model is ``GPT2LMHeadModel`` from a small ``GPT2Config`` with the library's defaults
(dropout 0.1, KV cache on), random weights; the data are random token ids, batch 4 x 64.
With a plan, ``RematCallback`` checkpoints the planned blocks before the first step; the loss
and the weights after training are those of the plain run (bit for bit on the CPU). A plan is
made for the Trainer's training step (``training_recipe``): by default the Trainer clips
gradients at norm 1.0 and uses fused AdamW, hence ``--clip-grad-norm 1 --fused`` above.
"""

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

import planner
from planner.integrations.hf import RematCallback, trainer_optimizer, training_recipe

CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512, "n_positions": 64,
          "n_embd": 64, "n_layer": 4, "n_head": 4, "bos_token_id": 0, "eos_token_id": 0}
BATCH_SIZE, SEQ_LEN, ROWS = 4, 64, 64


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(GPT2Config(**CONFIG))


def dataset(seq_len: int = SEQ_LEN) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS, seq_len), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def example_inputs(seq_len: int = SEQ_LEN, batch: int = BATCH_SIZE) -> dict[str, torch.Tensor]:
    """The first batch the Trainer trains on; with build_model() this file is a model file too
    (``seq_len``/``batch``: other shapes, for a bucketed plan)."""
    rows = dataset(seq_len)[:batch]
    return {k: torch.stack([row[k] for row in rows]) for k in ("input_ids", "labels")}


def training_args(output_dir: str, *, steps: int = 3, **overrides) -> TrainingArguments:
    """The Trainer's arguments: batch 4, lr 1e-3, a log line per step, on the CPU unless CUDA is there."""
    return TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=BATCH_SIZE, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True, **overrides)


def make_plan(budget: str, *, solver: str = "auto", seq_lens: tuple[int, ...] = (SEQ_LEN,),
              **overrides) -> planner.Plan:
    """Profile a copy of the model on one batch (here, on the CPU), running the training step the
    Trainer with ``overrides`` runs (``training_recipe``, and its optimizer: ``trainer_optimizer``),
    and plan it for ``budget``; with several ``seq_lens``, one batch of each: a bucketed plan
    (NOTE [ Bucketed plans ])."""
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(tmp, **overrides)
    return planner.plan(build_model(), budget, buckets=[example_inputs(n) for n in seq_lens], device="cpu",
                        solver=solver, steps=1, recipe=training_recipe(args), optimizer=trainer_optimizer(args))


class LossRecorder(TrainerCallback):
    """The loss of every step, unrounded (the Trainer's log rounds it)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def train(plan=None, *, steps: int = 3, output_dir: str | None = None, seq_len: int = SEQ_LEN, **overrides):
    """Train ``steps`` steps on rows of ``seq_len`` tokens; returns (losses, trained model)."""
    model = build_model()
    recorder = LossRecorder()
    callbacks = [recorder] + ([RematCallback(plan)] if plan is not None else [])
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(output_dir or tmp, steps=steps, **overrides)
        Trainer(model=model, args=args, train_dataset=dataset(seq_len), callbacks=callbacks).train()
    return recorder.losses, model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", help="plan.json from `remat plan --hf ...` (omit to train without a plan)")
    p.add_argument("--budget", help="plan in this script for this budget (e.g. 10MB) and train with the plan")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--write-config", metavar="DIR", help="write the model's config.json to DIR and stop")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the plan's summary line
    if args.write_config:
        folder = Path(args.write_config)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
        print(f"wrote {folder / 'config.json'}")
        return None
    plan = make_plan(args.budget) if args.budget else args.plan
    losses, _ = train(plan, steps=args.steps)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.6f}")
    return losses


if __name__ == "__main__":
    main()
