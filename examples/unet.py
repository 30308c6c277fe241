"""U-Net-style encoder-decoder in plain PyTorch (0.94M params), image-to-image regression.

Input conv, 3 encoder ``DownBlock``s in ``self.down`` (conv-GN-SiLU x2; each
returns its full-resolution output as a long skip tensor and a 2x-downsampled
copy), a ``Bottleneck`` at 1/8 resolution, 3 decoder ``UpBlock``s in
``self.up`` (2x upsample, concatenate the matching encoder skip, conv-GN-SiLU
x2), and a 1x1 output conv. The skip tensors are produced early and consumed
late, so they stay live across many blocks. Input: batch 8 x 3 x 64 x 64;
``loss_fn`` is the MSE against a fixed random target.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8
IMAGE_SIZE = 64
IN_CH = 3
OUT_CH = 3
WIDTHS = (32, 64, 96)
BOTTLENECK = 128


def _conv_block(in_ch: int, out_ch: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, padding=1),
        nn.GroupNorm(8, out_ch),
        nn.SiLU(),
        nn.Conv2d(out_ch, out_ch, 3, padding=1),
        nn.GroupNorm(8, out_ch),
        nn.SiLU(),
    )


class DownBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.conv = _conv_block(in_ch, out_ch)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor):
        skip = self.conv(x)
        return self.pool(skip), skip


class Bottleneck(nn.Module):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.conv = _conv_block(in_ch, out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class UpBlock(nn.Module):
    def __init__(self, in_ch: int, skip_ch: int, out_ch: int):
        super().__init__()
        self.upsample = nn.ConvTranspose2d(in_ch, out_ch, 2, stride=2)
        self.conv = _conv_block(out_ch + skip_ch, out_ch)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.upsample(x)
        return self.conv(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    def __init__(self, in_ch: int = IN_CH, out_ch: int = OUT_CH, widths=WIDTHS,
                 bottleneck: int = BOTTLENECK):
        super().__init__()
        self.inc = nn.Conv2d(in_ch, widths[0], 3, padding=1)
        chans = [widths[0], *widths]
        self.down = nn.ModuleList(
            [DownBlock(chans[i], chans[i + 1]) for i in range(len(widths))]
        )
        self.mid = Bottleneck(widths[-1], bottleneck)
        ups = []
        prev = bottleneck
        for w in reversed(widths):
            ups.append(UpBlock(prev, w, w))
            prev = w
        self.up = nn.ModuleList(ups)
        self.outc = nn.Conv2d(widths[0], out_ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for block in self.down:
            x, skip = block(x)
            skips.append(skip)
        x = self.mid(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.outc(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return UNet()


def _batch():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH_SIZE, IN_CH, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    target = torch.randn(BATCH_SIZE, OUT_CH, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return images, target


_TARGET = _batch()[1]


def example_inputs() -> torch.Tensor:
    return _batch()[0]


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), _TARGET.to(output.device))
