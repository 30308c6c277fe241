"""``remat ... --hf config.json``: Hugging Face models planned from their config, no model file.

The configs are written here (tiny sizes, library defaults otherwise), for six families: GPT-2,
Llama, Qwen2, BERT (masked LM), T5 (seq2seq) and ViT (images).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from planner.model.schema import Plan, Profile
from tests.conftest import invoke

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed"),
              pytest.mark.usefixtures("one_thread", "bytes_only")]
"""What these tests check is the files and bytes: one intra-op thread and the fewest dispatch-timing rounds
(tests/conftest.py)."""

_TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
         "vocab_size": 256, "max_position_embeddings": 64}
CONFIGS = {
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2, "n_head": 4,
             "vocab_size": 256, "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0},
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_TEXT, "num_key_value_heads": 2},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_TEXT, "num_key_value_heads": 2},
    "bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"], **_TEXT},
    "t5": {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 32, "d_ff": 64,
           "d_kv": 8, "num_layers": 2, "num_heads": 4, "vocab_size": 256, "decoder_start_token_id": 0},
    "vit": {"model_type": "vit", "architectures": ["ViTForImageClassification"], **_TEXT, "image_size": 16,
            "patch_size": 8, "num_labels": 3},
}
INPUTS = {"t5": ["decoder_input_ids", "input_ids", "labels"], "vit": ["labels", "pixel_values"]}
SHAPE = ("--batch", "2", "--seq-len", "16")


def write_config(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_plan_hf_config_of_each_family(tmp_path: Path, family: str):
    folder = write_config(tmp_path / family, CONFIGS[family])
    out = tmp_path / "plan.json"
    r = invoke("plan", "--hf", folder, *SHAPE, "--budget", "1GB", "--device", "cpu", "--steps", "1", "-o", out)
    assert r.exit_code == 0, r.output
    assert "plan that step with --clip-grad-norm 1 --fused" in r.output  # the Trainer's step, not the plain loop
    fp = Plan.load(out).fingerprint
    assert fp.model_class == CONFIGS[family]["architectures"][0]
    assert sorted(i.name for i in fp.inputs) == INPUTS.get(family, ["input_ids", "labels"])
    if family != "vit":
        assert next(i.shape for i in fp.inputs if i.name == "input_ids") == [2, 16]


def test_task_without_architectures_and_meta_device(tmp_path: Path):
    data = {k: v for k, v in CONFIGS["llama"].items() if k != "architectures"}
    folder = write_config(tmp_path / "llama", data)
    out = tmp_path / "profile.json"
    r = invoke("profile", "--hf", folder / "config.json", *SHAPE, "--task", "causal-lm", "--device", "meta",
               "--target", "h100", "-o", out, "-q")
    assert r.exit_code == 0, r.output
    prof = Profile.load(out)
    assert prof.device == "meta" and prof.fingerprint.model_class == "LlamaForCausalLM"


def test_profile_then_compare_frontier_and_verify_take_hf(tmp_path: Path):
    folder = write_config(tmp_path / "gpt2", CONFIGS["gpt2"])
    prof, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert invoke("profile", "--hf", folder, *SHAPE, "--device", "cpu", "--steps", "1", "-o", prof).exit_code == 0
    r = invoke("compare", "--hf", folder, *SHAPE, "--profile", prof, "--budget", "1GB", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["kind"] == "remat-compare", r.output
    r = invoke("frontier", "--hf", folder, *SHAPE, "--profile", prof, "--points", "2", "--json")
    assert r.exit_code == 0, r.output
    r = invoke("compare", "--hf", folder, "--batch", "4", "--seq-len", "16", "--profile", prof, "--budget", "1GB")
    assert r.exit_code == 2 and "input input_ids" in r.output  # the profile is for 2 rows, not 4
    assert invoke("plan", "--profile", prof, "--solver", "all", "--budget", "1GB", "-o", plan, "-q").exit_code == 0
    r = invoke("verify", "--hf", folder, *SHAPE, plan, "--device", "cpu", "--steps", "1", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["max_grad_diff"] == 0 and report["measured_recomputes"] > 0


@pytest.mark.parametrize(("data", "args", "needle"), [
    ({**CONFIGS["gpt2"], "architectures": ["GPT9000ForMagic"]}, SHAPE, "'GPT9000ForMagic' in"),
    ({k: v for k, v in CONFIGS["gpt2"].items() if k != "architectures"}, SHAPE, "names no architectures; add --task"),
    ({k: v for k, v in CONFIGS["bert"].items() if k != "vocab_size"} | {"vocab_size": None}, SHAPE, "field 'vocab_size'"),
    ({**CONFIGS["gpt2"], "model_type": "gpt9000"}, SHAPE, "model_type 'gpt9000'"),
    (CONFIGS["gpt2"], ("--batch", "2", "--seq-len", "65"), "longer than the model's 64 positions"),
    (CONFIGS["gpt2"], ("--seq-len", "16"), "--hf needs --batch N"),
    (CONFIGS["gpt2"], ("--batch", "2"), "needs --seq-len N"),
    (CONFIGS["gpt2"], (*SHAPE, "--task", "speech"), "--task 'speech' is unknown"),
], ids=["unknown-architecture", "no-architectures", "no-vocab", "unknown-model-type", "too-long", "no-batch",
        "no-seq-len", "unknown-task"])
def test_bad_configs_give_one_line(tmp_path: Path, data: dict, args: tuple, needle: str):
    folder = write_config(tmp_path / "cfg", data)
    r = invoke("plan", "--hf", folder, *args, "--budget", "1GB", "--device", "cpu")
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
    assert len([line for line in r.output.splitlines() if line.startswith("error:")]) == 1


def test_unreadable_json_and_missing_file(tmp_path: Path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = invoke("plan", "--hf", bad, *SHAPE, "--budget", "1GB")
    assert r.exit_code == 2 and "is not valid JSON" in r.output, r.output
    r = invoke("plan", "--hf", tmp_path / "nowhere", *SHAPE, "--budget", "1GB")
    assert r.exit_code == 2 and "does not exist" in r.output, r.output
    r = invoke("plan", "--batch", "2", "--budget", "1GB", "--profile", bad)
    assert r.exit_code == 2 and "--batch and --seq-len make batches of a model: give MODEL.py" in r.output, r.output
