"""A tiny Hugging Face Llama (``LlamaForCausalLM``) for pipeline stages: library defaults but the
sizes (4 layers, hidden 128, MLP 352, 4 heads, vocab 1024; no weights downloaded). Input: one
data-parallel replica's batch, 8 x 128 tokens as ``dict(input_ids=..., labels=...)``; the loss is
the model's own (``output.loss``).

    remat plan examples/llama_pp.py --pp 2 --schedule 1f1b --micro-batches 4 --budget 60MB -o plan.json
    remat verify examples/llama_pp.py plan.json          # 2 local ranks, one row per stage
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 1024


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4)
    return LlamaForCausalLM(config).train()


def example_inputs(seq_len: int = 128, batch: int = 8):
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB_SIZE, (batch, seq_len), generator=g)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
