"""GPT-style decoder-only transformer in plain PyTorch (3.5M params).

6 pre-LN blocks, d_model 192, 6 heads, MLP 4x, vocab 2048, context 256, dropout 0.1.
Input: batch 4 x 256 tokens with next-token targets; forward returns the mean
cross-entropy loss (``loss_fn`` is the identity).

Structure (names matter to the planner): ``tok_emb``, ``pos_emb``, ``drop``,
``blocks`` (``nn.ModuleList`` of ``Block``: ``ln_1``, ``attn``
(``CausalSelfAttention``: ``qkv``, ``proj``, ``resid_drop``), ``ln_2``, ``mlp``
(``MLP``: ``fc``, ``act``, ``proj``, ``drop``)), ``ln_f``, ``lm_head``.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 2048
BLOCK_SIZE = 256
N_LAYER = 6
N_HEAD = 6
D_MODEL = 192
DROPOUT = 0.1
BATCH_SIZE = 4
SEQ_LEN = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = BLOCK_SIZE,
        n_layer: int = N_LAYER,
        n_head: int = N_HEAD,
        d_model: int = D_MODEL,
        dropout: float = DROPOUT,
    ):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            [Block(d_model, n_head, dropout) for _ in range(n_layer)]
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        assert t <= self.block_size
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT()


def example_inputs(seq_len: int = SEQ_LEN, batch: int = BATCH_SIZE):
    """One batch; ``seq_len``/``batch`` make other shapes (``remat plan --seq-len ...``)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB_SIZE, (batch, seq_len + 1), generator=g)
    return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    return output
