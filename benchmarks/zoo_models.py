"""The conformance zoo's models: built from their config classes, library defaults otherwise.

One table (``SPECS``) that ``benchmarks/zoo.py`` and ``tests/test_zoo.py`` both read. Every
model is built as a user would build it: sizes are set small (hidden width, depth, vocabulary,
image size), every other option keeps the library's default (caches on, dropout as the config
has it, the default attention implementation). Nothing is downloaded.

A ``ModelSpec`` builds the model and one training batch for a ``Size``; ``FULL`` is what the
benchmark runs, ``TINY`` what CI runs. A spec whose library cannot be imported (torchvision and
timm need a CUDA build of their wheels here) reports why with ``missing()`` and is skipped.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Size:
    """The few sizes a zoo model is built at; everything else is the library's default."""

    hidden: int  # width of transformers; the widest stage of CNNs
    layers: int  # blocks per stack (encoder and decoder each, for encoder-decoders)
    heads: int  # attention heads; grouped-query models get heads // 2 key/value heads
    vocab: int
    batch: int
    seq: int  # tokens per sequence (source and target, for encoder-decoders)
    image: int  # pixels per side of the square input images


FULL = Size(hidden=128, layers=4, heads=4, vocab=1000, batch=4, seq=128, image=128)
TINY = Size(hidden=64, layers=2, heads=2, vocab=256, batch=2, seq=64, image=64)


@dataclass(frozen=True)
class ModelSpec:
    """One zoo model: how to build it and a batch for it, and what it needs installed."""

    name: str
    family: str  # decoder, moe, encoder, vision, enc-dec, ssm, speech, lora, cnn, shared, pytorch
    build: Callable[[Size], nn.Module]
    inputs: Callable[[Size], Any]
    requires: str = "transformers"  # the import the spec needs
    loss_fn: Callable[[Any], torch.Tensor] | None = None  # None: output.loss, else the sum of outputs

    def missing(self) -> str | None:
        """Why this spec cannot run here (its library does not import), or None."""
        try:
            importlib.import_module(self.requires)
        except Exception as e:  # torchvision with a CPU torch raises RuntimeError, not ImportError
            return f"{self.requires} cannot be imported: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return None


# ----------------------------------------------------------------------------- batches


def _ids(s: Size, vocab: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # ids from 3 up: no pad, bos or eos id, so no position is masked or ignored by the loss
    return torch.randint(3, vocab or s.vocab, (s.batch, s.seq), generator=g)


def _lm_batch(s: Size) -> dict:
    ids = _ids(s)
    return {"input_ids": ids, "labels": ids}


def _seq2seq_batch(s: Size) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": _ids(s), "labels": torch.randint(3, s.vocab, (s.batch, s.seq), generator=g)}


def _image_batch(s: Size, *, labels: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(s.batch, 3, s.image, s.image, generator=g)
    if not labels:
        return {"pixel_values": pixels}
    return {"pixel_values": pixels, "labels": torch.randint(0, 10, (s.batch,), generator=g)}


def _hf(model_class: str, config_class: str, **config: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**config)
    return getattr(transformers, model_class)(cfg)


# ----------------------------------------------------------------------------- decoders


def _llama_like(model_class: str, config_class: str,
                sized: Callable[[Size], dict] = lambda s: {}) -> Callable[[Size], nn.Module]:
    """Llama-shaped configs (grouped-query attention: half as many key/value heads as heads);
    ``sized`` adds the options whose defaults are sizes (expert widths)."""
    def build(s: Size) -> nn.Module:
        return _hf(model_class, config_class, vocab_size=s.vocab, hidden_size=s.hidden,
                   intermediate_size=s.hidden * 3, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                   num_key_value_heads=max(1, s.heads // 2), **sized(s))
    return build


def _gpt2(s: Size) -> nn.Module:
    return _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=s.vocab, n_embd=s.hidden, n_layer=s.layers,
               n_head=s.heads, bos_token_id=s.vocab - 1, eos_token_id=s.vocab - 1)  # its defaults are ids of the 50k vocab


def _gpt_neox(s: Size) -> nn.Module:
    return _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=s.vocab, hidden_size=s.hidden,
               intermediate_size=s.hidden * 4, num_hidden_layers=s.layers, num_attention_heads=s.heads)


def _opt(s: Size) -> nn.Module:
    return _hf("OPTForCausalLM", "OPTConfig", vocab_size=s.vocab, hidden_size=s.hidden, ffn_dim=s.hidden * 4,
               num_hidden_layers=s.layers, num_attention_heads=s.heads, word_embed_proj_dim=s.hidden)


def _phi(s: Size) -> nn.Module:
    return _hf("PhiForCausalLM", "PhiConfig", vocab_size=s.vocab, hidden_size=s.hidden,
               intermediate_size=s.hidden * 4, num_hidden_layers=s.layers, num_attention_heads=s.heads)


def _bloom(s: Size) -> nn.Module:
    return _hf("BloomForCausalLM", "BloomConfig", vocab_size=s.vocab, hidden_size=s.hidden, n_layer=s.layers,
               n_head=s.heads)


# ----------------------------------------------------------------------------- encoders


def _bert_like(model_class: str, config_class: str) -> Callable[[Size], nn.Module]:
    def build(s: Size) -> nn.Module:
        return _hf(model_class, config_class, vocab_size=s.vocab, hidden_size=s.hidden,
                   intermediate_size=s.hidden * 4, num_hidden_layers=s.layers, num_attention_heads=s.heads)
    return build


def _distilbert(s: Size) -> nn.Module:
    return _hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=s.vocab, dim=s.hidden,
               hidden_dim=s.hidden * 4, n_layers=s.layers, n_heads=s.heads)


def _albert(s: Size) -> nn.Module:
    # one layer group, its weights shared by every layer: the same module is called `layers` times
    return _hf("AlbertForMaskedLM", "AlbertConfig", vocab_size=s.vocab, embedding_size=s.hidden // 2,
               hidden_size=s.hidden, intermediate_size=s.hidden * 4, num_hidden_layers=s.layers * 2,
               num_attention_heads=s.heads)


def _vit(model_class: str, config_class: str) -> Callable[[Size], nn.Module]:
    def build(s: Size) -> nn.Module:
        return _hf(model_class, config_class, hidden_size=s.hidden, intermediate_size=s.hidden * 4,
                   num_hidden_layers=s.layers, num_attention_heads=s.heads, image_size=s.image, patch_size=8,
                   num_labels=10)
    return build


def _swin(s: Size) -> nn.Module:
    return _hf("SwinForImageClassification", "SwinConfig", image_size=s.image, patch_size=4, window_size=4,
               embed_dim=s.hidden // 4, depths=[2, 2], num_heads=[2, 4], num_labels=10)


# ----------------------------------------------------------------------------- encoder-decoders


def _t5(s: Size) -> nn.Module:
    return _hf("T5ForConditionalGeneration", "T5Config", vocab_size=s.vocab, d_model=s.hidden,
               d_kv=s.hidden // s.heads, d_ff=s.hidden * 4, num_layers=s.layers, num_heads=s.heads,
               decoder_start_token_id=0)  # T5's checkpoints set it (the pad id); training with labels needs it


def _bart(s: Size) -> nn.Module:
    return _hf("BartForConditionalGeneration", "BartConfig", vocab_size=s.vocab, d_model=s.hidden,
               encoder_layers=s.layers, decoder_layers=s.layers, encoder_attention_heads=s.heads,
               decoder_attention_heads=s.heads, encoder_ffn_dim=s.hidden * 4, decoder_ffn_dim=s.hidden * 4)


# ----------------------------------------------------------------------------- state spaces, speech, adapters


def _mamba(s: Size) -> nn.Module:
    # without mamba_ssm's kernels (none on the CPU) its mixer runs the reference scan, a Python loop over
    # tokens: a step that runs differently under a dispatch mode (NOTE [ Step as run ])
    return _hf("MambaForCausalLM", "MambaConfig", vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers)


def _wav2vec2(s: Size) -> nn.Module:
    # the library's defaults keep layerdrop (0.1, NOTE [ Worst step ]) and SpecAugment (time masks drawn from
    # numpy, NOTE [ Randomness outside torch ]) on while training; the vocabulary is its default 32 characters
    return _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", hidden_size=s.hidden, num_hidden_layers=s.layers,
               num_attention_heads=s.heads, intermediate_size=s.hidden * 4, conv_dim=(s.hidden // 2,) * 7)


def _speech_batch(s: Size) -> dict:
    g = torch.Generator().manual_seed(0)
    # 320 samples per frame (the feature encoder's strides), so ``seq`` frames; a transcript of seq // 4
    # characters (ids from 1: 0 is CTC's blank)
    return {"input_values": torch.randn(s.batch, 320 * s.seq + 80, generator=g),
            "labels": torch.randint(1, 32, (s.batch, s.seq // 4), generator=g)}


def _llama_lora(s: Size) -> nn.Module:
    # peft's defaults: rank 8, alpha 8, no dropout, on the modules peft picks for Llama (q_proj, v_proj);
    # the base model frozen
    from peft import LoraConfig, get_peft_model

    base = _llama_like("LlamaForCausalLM", "LlamaConfig")(s)
    torch.manual_seed(0)
    return get_peft_model(base, LoraConfig(task_type="CAUSAL_LM"))


# ----------------------------------------------------------------------------- CNNs


def _resnet(s: Size) -> nn.Module:
    return _hf("ResNetForImageClassification", "ResNetConfig", embedding_size=s.hidden // 4,
               hidden_sizes=[s.hidden // 4, s.hidden // 2, s.hidden], depths=[2, 2, 2], layer_type="basic",
               num_labels=10)


def _convnext(s: Size) -> nn.Module:
    return _hf("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[s.hidden // 4, s.hidden // 2,
               s.hidden], depths=[2, 2, 2], num_stages=3, num_labels=10)


def _mobilenet_v2(s: Size) -> nn.Module:
    return _hf("MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=s.image,
               depth_multiplier=0.35, num_labels=10)


# ----------------------------------------------------------------------------- plain PyTorch


def _transformer_encoder(s: Size) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(s.hidden, s.heads, dim_feedforward=s.hidden * 4, batch_first=True)
    return nn.TransformerEncoder(layer, s.layers)


def _mean_square(output: torch.Tensor) -> torch.Tensor:
    # not the sum: a sum after a LayerNorm is constant, and its gradient vanishes
    return output.float().square().mean()


def _tokens(s: Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(s.batch, s.seq, s.hidden, generator=g)


class SharedAround(nn.Module):
    """A module ``s`` called before and after a stack of blocks: one decision for the planner."""

    def __init__(self, s: Size):
        super().__init__()
        width = s.hidden
        self.s = nn.Sequential(nn.Linear(width, width * 4), nn.GELU(), nn.Linear(width * 4, width))
        self.h = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width * 4), nn.GELU(), nn.Linear(width * 4, width))
            for _ in range(s.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.s(x)
        for block in self.h:
            x = x + block(x)
        return x + self.s(x)


def _shared_around(s: Size) -> nn.Module:
    torch.manual_seed(0)
    return SharedAround(s)


def _torchvision_resnet18(s: Size) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _timm_vit(s: Size) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=s.image, patch_size=8,
                             num_classes=10)


def _images(s: Size) -> torch.Tensor:
    return _image_batch(s, labels=False)["pixel_values"]


# ----------------------------------------------------------------------------- the table


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec("llama", "decoder", _llama_like("LlamaForCausalLM", "LlamaConfig"), _lm_batch),
    ModelSpec("mistral", "decoder", _llama_like("MistralForCausalLM", "MistralConfig"), _lm_batch),
    ModelSpec("qwen2", "decoder", _llama_like("Qwen2ForCausalLM", "Qwen2Config"), _lm_batch),
    ModelSpec("gemma", "decoder", _llama_like("GemmaForCausalLM", "GemmaConfig",
                                                        lambda s: {"head_dim": s.hidden // s.heads}), _lm_batch),
    ModelSpec("phi", "decoder", _phi, _lm_batch),
    ModelSpec("gpt2", "decoder", _gpt2, _lm_batch),
    ModelSpec("gpt-neox", "decoder", _gpt_neox, _lm_batch),
    ModelSpec("opt", "decoder", _opt, _lm_batch),
    ModelSpec("bloom", "decoder", _bloom, _lm_batch),
    ModelSpec("mixtral", "moe", _llama_like("MixtralForCausalLM", "MixtralConfig",
                                                   lambda s: {"num_local_experts": 4}), _lm_batch),
    ModelSpec("qwen2-moe", "moe", _llama_like(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        lambda s: {"num_experts": 4, "moe_intermediate_size": s.hidden, "shared_expert_intermediate_size": s.hidden * 2}), _lm_batch),
    ModelSpec("bert", "encoder", _bert_like("BertForMaskedLM", "BertConfig"), _lm_batch),
    ModelSpec("roberta", "encoder", _bert_like("RobertaForMaskedLM", "RobertaConfig"), _lm_batch),
    ModelSpec("electra", "encoder", _bert_like("ElectraForMaskedLM", "ElectraConfig"), _lm_batch),
    ModelSpec("distilbert", "encoder", _distilbert, _lm_batch),
    ModelSpec("albert", "shared", _albert, _lm_batch),
    ModelSpec("vit", "vision", _vit("ViTForImageClassification", "ViTConfig"), _image_batch),
    ModelSpec("deit", "vision", _vit("DeiTForImageClassification", "DeiTConfig"), _image_batch),
    ModelSpec("swin", "vision", _swin, _image_batch),
    ModelSpec("t5", "enc-dec", _t5, _seq2seq_batch),
    ModelSpec("bart", "enc-dec", _bart, _seq2seq_batch),
    ModelSpec("mamba", "ssm", _mamba, _lm_batch),
    ModelSpec("wav2vec2", "speech", _wav2vec2, _speech_batch),
    ModelSpec("llama-lora", "lora", _llama_lora, _lm_batch, requires="peft"),
    ModelSpec("resnet", "cnn", _resnet, _image_batch),
    ModelSpec("convnext", "cnn", _convnext, _image_batch),
    ModelSpec("mobilenet-v2", "cnn", _mobilenet_v2, _image_batch),
    ModelSpec("transformer-encoder", "pytorch", _transformer_encoder, _tokens, requires="torch",
              loss_fn=_mean_square),
    ModelSpec("shared-around", "shared", _shared_around, _tokens, requires="torch",
              loss_fn=_mean_square),
    ModelSpec("torchvision-resnet18", "cnn", _torchvision_resnet18, _images, requires="torchvision"),
    ModelSpec("timm-vit", "vision", _timm_vit, _images, requires="timm"),
)

BY_NAME = {s.name: s for s in SPECS}
