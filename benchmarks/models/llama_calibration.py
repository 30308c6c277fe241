"""Hugging Face Llama (``LlamaForCausalLM``) sized for the roofline's calibration on a GPU.

benchmarks/gpu_check.py fits the roofline's efficiencies only on units it models at
``FIT_MIN_UNIT_MS`` (2 ms) or more: below that a unit's time is kernel launches and Python
(NOTE [ Roofline ]), and on an H200 every block of examples/gpt2.py and examples/llama.py is
modelled at about 0.13 ms. Here hidden 2048, SwiGLU MLP 5632, 16 query / 4 key-value heads and
batch 4 x 1024 tokens: about 0.37 TFLOP per block forward, some 25 ms forward and backward at
the fp32 roofline of an H100 or H200. About 0.2 B parameters, a few GB in all: a GPU model,
far too slow for a CPU. Library defaults otherwise; random weights from ``LlamaConfig``.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 8192
BATCH_SIZE = 4
SEQ_LEN = 1024


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    model.train()
    return model


def example_inputs():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=g)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
