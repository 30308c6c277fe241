"""Train a model file with PyTorch Lightning and a remat plan: the plan is one callback.

    remat plan examples/gpt2.py --budget 160MB -o plan.json
    python examples/lightning_train.py examples/gpt2.py --plan plan.json --steps 3
    python examples/lightning_train.py examples/gpt2.py --steps 3        # no plan: the baseline

Needs ``pip install 'remat[lightning]'``. The ``LightningModule`` holds the model file's model as
``self.model`` (built in ``configure_model``); ``RematCallback`` finds it by the plan's model
class and checkpoints the planned modules before the strategy wraps the model. Every step trains on the model file's
``example_inputs()`` (a demo, not a data loader; ``--seq-len 128,512`` cycles through lengths, for a
bucketed plan made with ``remat plan --seq-len 128,512``). Losses and weights equal the plain run's (bit
for bit on the CPU).
"""

import argparse
import logging
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from planner.integrations.lightning import RematCallback
from planner.profiling.model_file import call_model, compute_loss, load_model_file


class ModelFileModule(pl.LightningModule):
    """The model of a model file, trained with AdamW on its loss.

    The model is built in ``configure_model``, as Lightning recommends for models that a
    sharding strategy wraps; ``RematCallback`` applies the plan right after that hook.
    """

    def __init__(self, model_file: str, lr: float = 1e-3):
        super().__init__()
        self.model_file = load_model_file(model_file)
        self.lr = lr
        self.losses: list[float] = []

    def configure_model(self):
        if getattr(self, "model", None) is None:  # Lightning may call it again (fit, then test)
            self.model = self.model_file.build_model()

    def training_step(self, batch, batch_idx):
        loss = compute_loss(self.model_file.loss_fn, call_model(self.model, batch), batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def train(model_file: str, plan=None, *, steps: int = 3, module_class=ModelFileModule,
          shapes: list[dict[str, int]] | None = None, **trainer_options):
    """Fit ``steps`` steps; returns the ``LightningModule`` (``.losses``, ``.model``, ``.trainer``).

    ``shapes``: ``example_inputs`` keyword arguments the steps cycle through (e.g. ``[{"seq_len": 128},
    {"seq_len": 512}]``, the lengths of a bucketed plan); default ``example_inputs()`` every step."""
    pl.seed_everything(0, verbose=False)
    module = module_class(model_file)
    mf, shapes = load_model_file(model_file), shapes or [{}]
    batches = [mf.example_inputs(**shapes[i % len(shapes)]) for i in range(steps)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # each item is one whole batch
    trainer = pl.Trainer(max_steps=steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RematCallback(plan)] if plan is not None else [], **trainer_options)
    trainer.fit(module, loader)
    return module


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="model file: build_model(), example_inputs(), optional loss_fn(output) "
                                 "or loss_fn(output, batch)")
    p.add_argument("--plan", help="plan.json from `remat plan` (omit to train without checkpointing)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", help="steps cycle through these lengths, e.g. 128,256,512 (a bucketed plan's); "
                                     "the model file's example_inputs takes seq_len")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the plan's summary line
    shapes = [{"seq_len": int(n)} for n in args.seq_len.split(",")] if args.seq_len else None
    module = train(args.model, args.plan, steps=args.steps, shapes=shapes)
    for step, loss in enumerate(module.losses):
        print(f"step {step}: loss {loss:.6f}")
    return module.losses


if __name__ == "__main__":
    main()
