"""Regenerate the reference profiles in profiles/models/ (solver tests and benchmarks plan on them, no torch).

    python benchmarks/make_reference_profiles.py              # all four, about a minute on 2 cores
    python benchmarks/make_reference_profiles.py gpt2-small   # one of them

Three are profiled on fake tensors for an H100 (``--device meta --target h100``: no memory
used, times from the roofline of docs/meta.md) and one is measured on this machine's CPU:

=======================  =====================================================================
file                     model, batch, precision
=======================  =====================================================================
gpt2-small-h100.json     HF GPT2LMHeadModel(GPT2Config()) (124M), batch 8 x 1024, fp32 weights,
                         --amp bf16, dropout 0.1 as configured
llama2-7b-h100.json      examples/llama7b.py: Llama-2-7B shapes (6.7B), bf16, batch 1 x 4096
resnet50-h100.json       ResNet-50 (bottlenecks 3-4-6-3, 25.6M) in plain PyTorch, batch 64 x
                         3 x 224 x 224, --amp bf16
gpt2-tiny-cpu.json       examples/gpt2.py measured on the CPU (3 timing steps)
=======================  =====================================================================

Every meta profile is a deterministic function of the model, the inputs, PyTorch's version
(``torch_version`` is recorded) and the target: a rerun changes only ``created_at``, the
creation time, kept as the profile schema has it. The CPU profile's times are measurements
and change from run to run (its bytes do not).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F
from torch import nn

from planner.profiling.meta import build_on_meta
from planner.profiling.model_file import load_model_file
from planner.model.schema import Recipe  # noqa: E402
from planner.profiling import profile
from profiles import MODELS_DIR


@dataclass(frozen=True)
class Reference:
    build: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    loss_fn: Callable[[Any], torch.Tensor] | None
    device: str
    target: str | None = None
    amp: str | None = None


# ----------------------------------------------------------------------------- GPT-2 small


def gpt2_small() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(use_cache=False, attn_implementation="sdpa")  # 124M: 12 x 768, vocab 50257
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def gpt2_small_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50257, (8, 1024), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


# ----------------------------------------------------------------------------- ResNet-50


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision's v1.5), 1x1 expand x4; projection shortcut."""

    def __init__(self, in_ch: int, width: int, stride: int):
        super().__init__()
        out_ch = width * 4
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(out_ch))
                           if stride != 1 or in_ch != out_ch else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, in_ch = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for i in range(blocks):
                stage.append(Bottleneck(in_ch, width, stride if i == 0 else 1))
                in_ch = width * 4
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_RESNET_LABELS = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(1))


def resnet50_inputs() -> torch.Tensor:
    return torch.randn(64, 3, 224, 224, generator=torch.Generator().manual_seed(0))


def resnet50_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), _RESNET_LABELS.to(logits.device))


# ----------------------------------------------------------------------------- the set


def _example(name: str) -> tuple[Callable[[], nn.Module], Callable[[], Any], Any]:
    mf = load_model_file(ROOT / "examples" / f"{name}.py")
    return mf.build_model, mf.example_inputs, mf.loss_fn


REFERENCES: dict[str, Callable[[], Reference]] = {
    "gpt2-small-h100": lambda: Reference(gpt2_small, gpt2_small_inputs, None, "meta", "h100", "bf16"),
    "llama2-7b-h100": lambda: Reference(*_example("llama7b"), "meta", "h100"),
    "resnet50-h100": lambda: Reference(ResNet50, resnet50_inputs, resnet50_loss, "meta", "h100", "bf16"),
    "gpt2-tiny-cpu": lambda: Reference(*_example("gpt2"), "cpu"),
}


def make(name: str) -> Path:
    ref = REFERENCES[name]()
    torch.manual_seed(0)
    model = build_on_meta(ref.build) if ref.device == "meta" else ref.build()
    prof = profile(model, ref.inputs(), loss_fn=ref.loss_fn, device=ref.device, target=ref.target,
                   recipe=Recipe(amp=ref.amp), steps=3)
    return prof.save(MODELS_DIR / f"{name}.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"profiles to make: {', '.join(REFERENCES)} (default: all)")
    names = parser.parse_args().names or list(REFERENCES)
    unknown = [n for n in names if n not in REFERENCES]
    if unknown:
        parser.error(f"unknown profile {unknown[0]!r}; choose from {', '.join(REFERENCES)}")
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.perf_counter()
        path = make(name)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 2**20:.2f} MiB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
