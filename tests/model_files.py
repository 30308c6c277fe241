"""Model files (source text) the CLI tests write and run; shared fixtures are in tests/conftest.py."""

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

# A tiny token model whose example_inputs takes seq_len and batch (a bucketed plan's model file):
# embedding, 4 residual MLP blocks, a head; activations grow with the tokens.
TINY_SEQ_MODEL = '''\
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))

class TinySeq(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids, labels):
        logits = self.head(self.blocks(self.embed(input_ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

def build_model():
    torch.manual_seed(0)
    return TinySeq()

def example_inputs(seq_len=32, batch=4):
    ids = torch.randint(0, 64, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}
'''
