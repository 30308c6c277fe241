"""Model files shared by the CLI tests."""

# A tiny model file: 4 Linear/ReLU blocks and a head; profiles in well under a second.
TINY_MODEL = '''\
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)], nn.Linear(32, 4))

def example_inputs():
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(0))

def loss_fn(output):
    return output.square().mean()
'''
