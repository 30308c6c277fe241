"""Hugging Face BERT (``BertForMaskedLM``) built from ``BertConfig``: library defaults except the sizes.

4 layers, hidden 256, 4 heads, intermediate 1024, vocab 4096; everything else as the config
class sets it (dropout 0.1 on hidden states and attention probabilities, GELU, LayerNorm).
Input: batch 8 x 128 tokens with every token as a label; the loss is ``output.loss``.
"""

import torch
from transformers import BertConfig, BertForMaskedLM

VOCAB_SIZE, BATCH_SIZE, SEQ_LEN = 4096, 8, 128


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024)
    return BertForMaskedLM(config).train()


def example_inputs():
    ids = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}
