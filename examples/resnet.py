"""ResNet-style CNN in plain PyTorch (1.05M params), 10-class image classifier.

Stem conv3x3(3->32)-BN-ReLU at 64x64, then 4 stages ``layer1``..``layer4``
(``nn.Sequential`` of 2 ``BasicBlock``: conv3x3-BN-ReLU-conv3x3-BN + shortcut,
1x1 conv-BN shortcut when the shape changes), widths 32/64/96/128 at
64/32/16/8 px, global average pool, ``fc``. Input: batch 8 x 3 x 64 x 64 images
plus integer labels; forward returns logits, ``loss_fn`` is cross-entropy
against fixed labels. BatchNorm (no dropout), so training-mode BN running
statistics are updated on every forward.
"""

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 10
BATCH_SIZE = 8
IMAGE_SIZE = 64
WIDTHS = (32, 64, 96, 128)


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _stage(in_ch: int, out_ch: int, stride: int) -> nn.Sequential:
    return nn.Sequential(BasicBlock(in_ch, out_ch, stride), BasicBlock(out_ch, out_ch, 1))


class ResNet(nn.Module):
    def __init__(self, widths=WIDTHS, num_classes: int = NUM_CLASSES):
        super().__init__()
        w1, w2, w3, w4 = widths
        self.stem = nn.Sequential(
            nn.Conv2d(3, w1, 3, padding=1, bias=False),
            nn.BatchNorm2d(w1),
            nn.ReLU(),
        )
        self.layer1 = _stage(w1, w1, 1)
        self.layer2 = _stage(w1, w2, 2)
        self.layer3 = _stage(w2, w3, 2)
        self.layer4 = _stage(w3, w4, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return ResNet()


def _batch():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (BATCH_SIZE,), generator=g)
    return images, labels


_LABELS = _batch()[1]


def example_inputs() -> torch.Tensor:
    return _batch()[0]


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), _LABELS.to(output.device))
