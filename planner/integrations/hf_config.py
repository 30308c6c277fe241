"""A Hugging Face model from its ``config.json``: what ``remat plan --hf config.json`` profiles.

``load_hf_config(path, batch_size=8, seq_len=2048)`` returns the same ``ModelFile`` a
``model.py`` gives, so every command and ``verify`` take either. The model is built with the
library's defaults from the config, as ``AutoModel*.from_config`` builds it (its ``dtype``
included); the inputs are one random batch of the model's main inputs:

- text models: ``input_ids`` (batch x seq_len, ids below the vocabulary size) and ``labels``
  (the ids again for causal and masked LMs and for seq2seq models, which shift them into
  their decoder inputs; one class id per row for classification);
- vision models (main input ``pixel_values``): images of the config's ``image_size`` and
  ``num_channels``, and class ids for classification.

The model class is the config's ``architectures[0]``, or the ``task``'s auto class.

Example::

    mf = load_hf_config("config.json", batch_size=8, seq_len=2048)
    prof = planner.profile(mf, step=StepSpec(device="meta", target="h100"))
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from planner.errors import ModelLoadError
from planner.files import device_kind
from planner.profiling.model_file import ModelFile

TASKS = ("causal-lm", "seq2seq", "masked-lm", "classification")
"""``--task`` values, each naming the auto class that builds the model."""

_TASK_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "masked-lm": "AutoModelForMaskedLM",
    "classification": "AutoModelForSequenceClassification",
}
_IMAGE_CLASSIFICATION = "AutoModelForImageClassification"
_SEED = 0
"""Seed of the random batch: the same config and shapes give the same inputs."""


def load_hf_config(path: str | Path, *, batch_size: int, seq_len: int | None = None,
                   task: str | None = None) -> ModelFile:
    """The model of a Hugging Face ``config.json`` (or a folder holding one) and one batch for it.

    Args:
        path: ``config.json``, or the folder of a Hugging Face checkpoint that holds it.
        batch_size: rows in the batch (>= 1).
        seq_len: tokens per row (text models; ignored by vision models).
        task: one of ``TASKS``; default the config's ``architectures[0]``.

    Raises:
        ModelLoadError: the file is missing or not JSON, transformers is not installed, or the
            config names no architecture (and no ``task``), one transformers lacks, no
            vocabulary, or positions fewer than ``seq_len``.
    """
    transformers = _transformers()
    file = _config_path(Path(path))
    data = _read_json(file)
    cls = _model_class(transformers, data, task, file)
    config = _config(transformers, data, cls, file)
    if batch_size < 1:
        raise ModelLoadError(f"--batch must be at least 1, got {batch_size}")
    vision = _is_vision(cls, config)
    if vision and task == "classification":
        cls = getattr(transformers, _IMAGE_CLASSIFICATION)
    classify = task == "classification" or "Classification" in cls.__name__
    if vision:
        make_inputs = _image_batch(config, file, batch_size=batch_size, classify=classify)
    else:
        make_inputs = _token_batch(config, file, batch_size=batch_size, seq_len=seq_len, classify=classify)
    return ModelFile(build_model=lambda: _build(cls, config, file), example_inputs=make_inputs,
                     loss_fn=None, path=file)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelLoadError("--hf needs Hugging Face transformers: pip install 'remat[hf]'") from None
    return transformers


def _config_path(path: Path) -> Path:
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        where = f"{path} has no config.json" if path.is_dir() else f"{path} does not exist"
        raise ModelLoadError(f"--hf: {where}; pass a Hugging Face config.json or the folder that holds it")
    if device := device_kind(file):  # /dev/zero was read until memory ran out
        raise ModelLoadError(f"--hf: {file} is {device}; pass a Hugging Face config.json or the folder that holds it")
    return file


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelLoadError(f"--hf: cannot read {file}: {e.strerror or e}") from None
    except ValueError as e:
        raise ModelLoadError(f"--hf: {file} is not valid JSON ({e}); pass a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"--hf: {file} holds a JSON {type(data).__name__}, not a config object")
    return data


def _model_class(transformers: Any, data: dict[str, Any], task: str | None, file: Path) -> Any:
    """The class that builds the model: ``task``'s auto class, else ``architectures[0]``."""
    if task is not None:
        if task not in _TASK_CLASSES:
            raise ModelLoadError(f"--task {task!r} is unknown; choose one of {', '.join(TASKS)}")
        return getattr(transformers, _TASK_CLASSES[task])
    names = data.get("architectures") or []
    if not names:
        raise ModelLoadError(f"--hf: {file} names no architectures; add --task ({', '.join(TASKS)})")
    cls = getattr(transformers, str(names[0]), None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise ModelLoadError(f"--hf: architecture {names[0]!r} in {file} is not a model class of transformers "
                             f"{transformers.__version__} (custom code is not run); add --task "
                             f"({', '.join(TASKS)}) to build the model from the config's model_type")
    return cls


def _config(transformers: Any, data: dict[str, Any], cls: Any, file: Path) -> Any:
    model_type = data.get("model_type")
    config_class = getattr(cls, "config_class", None)
    if model_type is not None:
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except KeyError:
            raise ModelLoadError(f"--hf: model_type {model_type!r} in {file} is unknown to transformers "
                                 f"{transformers.__version__}") from None
    if config_class is None:
        raise ModelLoadError(f"--hf: {file} has no model_type; add the model_type of the config (e.g. \"llama\")")
    try:
        return config_class.from_dict(data)
    except Exception as e:  # noqa: BLE001 -- transformers validates the fields in many ways
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ModelLoadError(f"--hf: transformers rejects {file}: {reason}") from None


def _build(cls: Any, config: Any, file: Path) -> torch.nn.Module:
    # The auto classes and from_pretrained build through _from_config: the config's dtype and
    # attention implementation apply, as they do for a user's from_config.
    build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    try:
        model = build(config)
    except ValueError as e:  # an auto class without this model_type
        raise ModelLoadError(f"--hf: cannot build {cls.__name__} from {file}: {str(e).splitlines()[0]}") from None
    return model.train()


def _is_vision(cls: Any, config: Any) -> bool:
    """Images in: the class's main input is ``pixel_values``, or (an auto class) the config has no vocabulary."""
    main = getattr(cls, "main_input_name", None)
    if isinstance(main, str):
        return main == "pixel_values"
    return hasattr(config, "image_size") and getattr(config.get_text_config(), "vocab_size", None) is None


def _token_batch(config: Any, file: Path, *, batch_size: int, seq_len: int | None,
                 classify: bool) -> Callable[[], dict[str, torch.Tensor]]:
    """Token ids and labels (see the module docstring)."""
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not vocab:
        raise ModelLoadError(f"--hf: {file} has no vocab_size, so no token ids can be drawn; add \"vocab_size\"")
    if seq_len is None:
        raise ModelLoadError("--hf with a text model needs --seq-len N (tokens per row), e.g. --seq-len 2048")
    positions = _max_positions(config)
    labels = getattr(config, "num_labels", 2) if classify else None
    start = _decoder_start(config) if getattr(config, "is_encoder_decoder", False) and not classify else None

    def check(tokens: int) -> int:
        if positions is not None and tokens > positions:
            raise ModelLoadError(f"--seq-len {tokens} is longer than the model's {positions} positions "
                                 f"(max_position_embeddings in {file})")
        return tokens

    default_len = check(seq_len)

    def make(batch: int | None = None, seq_len: int | None = None) -> dict[str, torch.Tensor]:
        """One batch; ``batch`` rows of ``seq_len`` tokens when given (a bucket of a bucketed plan)."""
        rows, tokens = batch or batch_size, check(seq_len or default_len)
        g = torch.Generator().manual_seed(_SEED)
        ids = torch.randint(0, vocab, (rows, tokens), generator=g)
        target = torch.randint(0, labels, (rows,), generator=g) if labels else ids.clone()
        out = {"input_ids": ids, "labels": target}
        if start is not None:  # as DataCollatorForSeq2Seq does: the labels shifted right
            out["decoder_input_ids"] = torch.cat([torch.full((rows, 1), start), target[:, :-1]], dim=1)
        return out

    return make


def _decoder_start(config: Any) -> int:
    """The id a seq2seq decoder starts from: ``decoder_start_token_id``, else the pad id, else 0."""
    for name in ("decoder_start_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0


def _image_batch(config: Any, file: Path, *, batch_size: int, classify: bool) -> Callable[[], dict[str, torch.Tensor]]:
    size = getattr(config, "image_size", None)
    if size is None:
        raise ModelLoadError(f"--hf: {file} has no image_size, so no images can be drawn; add \"image_size\"")
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)
    dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
    labels = getattr(config, "num_labels", 2) if classify else None

    def make(batch: int | None = None, seq_len: int | None = None) -> dict[str, torch.Tensor]:
        """One batch of ``batch`` images when given; ``seq_len`` does not apply to images."""
        rows = batch or batch_size
        g = torch.Generator().manual_seed(_SEED)
        out = {"pixel_values": torch.randn(rows, channels, height, width, generator=g).to(dtype)}
        if labels:
            out["labels"] = torch.randint(0, labels, (rows,), generator=g)
        return out

    return make


def _max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


__all__ = ["load_hf_config", "TASKS"]
