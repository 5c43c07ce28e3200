"""A saved Spider folder loads with the Auto classes and trust_remote_code in a fresh process elsewhere."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from configuration_spider import SpiderConfig
from modeling_spider import SpiderForConditionalGeneration
from tests.helpers import REMOTE_CODE_FILES, float_tol, model_terms
from tokenization_spider import SpiderTokenizer

LOADER = r"""
import json, sys, torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
assert not any("modeling_spider" in m for m in sys.modules)
config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
lm = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
ids = tok(["Four score and seven", "years ago"], padding=True, return_tensors="pt")
with torch.no_grad():
    logits = lm(**ids).logits
    hidden = base(**ids).last_hidden_state
print(json.dumps({
    "config_class": type(config).__name__, "lm_class": type(lm).__name__, "base_class": type(base).__name__,
    "tok_class": type(tok).__name__, "modules": [type(o).__module__ for o in (config, lm, base, tok)],
    "input_ids": ids["input_ids"].tolist(),
    "attention_mask": ids["attention_mask"].tolist(), "logits": logits.tolist(), "hidden": hidden.tolist(),
}))
"""


def test_save_then_load_in_fresh_process_from_another_directory(tmp_path):
    torch.manual_seed(0)
    model = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny")).eval()
    tok = SpiderTokenizer()
    folder = tmp_path / "release"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)

    files = set(os.listdir(folder))
    assert {"model.safetensors", "config.json", *REMOTE_CODE_FILES, "tokenizer_config.json"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_spider.SpiderForConditionalGeneration"
    assert auto_map["AutoModel"] == "modeling_spider.SpiderModel"
    assert auto_map["AutoConfig"] == "configuration_spider.SpiderConfig"
    assert set(load_file(folder / "model.safetensors")) == set(model.state_dict())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", LOADER, str(folder)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert (got["config_class"], got["lm_class"], got["base_class"], got["tok_class"]) == (
        "SpiderConfig",
        "SpiderForConditionalGeneration",
        "SpiderModel",
        "SpiderTokenizer",
    )
    # the classes come from the folder's code through transformers' dynamic modules, not from this repository
    assert all(m.startswith("transformers_modules.") for m in got["modules"]), got["modules"]
    ids = torch.tensor(got["input_ids"])
    mask = torch.tensor(got["attention_mask"])
    with torch.no_grad():
        expected = model(ids, attention_mask=mask)
    # another process (its own thread pool); logits went through JSON as Python floats (exact for fp32)
    torch.testing.assert_close(
        torch.tensor(got["logits"]), expected.logits, **float_tol(expected.logits, model_terms(model))
    )
    hidden = model.model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(torch.tensor(got["hidden"]), hidden, **float_tol(hidden, model_terms(model)))


FROM_CONFIG = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from configuration_spider import SpiderConfig
from transformers import AutoModel, AutoModelForCausalLM
config = SpiderConfig.from_preset("tiny")
lm = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
base = AutoModel.from_config(config, trust_remote_code=True)
logits = lm(torch.tensor([[257, 72, 105]])).logits
print(json.dumps({"lm": type(lm).__name__, "base": type(base).__name__, "shape": list(logits.shape)}))
"""


def test_from_config_with_a_config_built_in_code(tmp_path):
    """`AutoModelForCausalLM.from_config(SpiderConfig.from_preset(...), trust_remote_code=True)` builds the model:
    a config built in code names the folder of its own files for `auto_map` (it raised HFValidationError on an empty
    repo id), and that name never reaches config.json."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    env["HF_HUB_OFFLINE"] = "1"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", FROM_CONFIG, repo], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"lm": "SpiderForConditionalGeneration", "base": "SpiderModel", "shape": [1, 3, 272]}
    folder = tmp_path / "saved"
    SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny")).save_pretrained(folder)
    assert "_name_or_path" not in json.loads((folder / "config.json").read_text())


def test_release_with_flat_legacy_names_loads_with_the_legacy_key_mapping(tmp_path):
    """A release written before the recurrent block and FlexiTokens were modules (parameters flat under `model.`, and
    the segmentation's older names `null_group`, `down_norm`, `upsample_norm`) loads every tensor with
    `key_mapping=LEGACY_KEY_MAPPING`; without it those tensors would be re-initialised."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from spider_training.release import LEGACY_KEY_MAPPING

    torch.manual_seed(0)
    model = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny", expand_mixing="residual_proj")).eval()
    model.save_pretrained(tmp_path)
    current = model.state_dict()
    older_names = {"null_segment": "null_group", "pool_norm": "down_norm", "expand_norm": "upsample_norm"}
    legacy = {}
    for key, value in current.items():
        for new, old in older_names.items():
            key = key.replace(f"flexitokens.{new}", f"flexitokens.{old}")
        key = key.replace("model.recurrent_block.", "model.").replace("model.flexitokens.", "model.")
        legacy[key] = value.contiguous()
    assert {
        "model.layers.0.mlp.router.weight",
        "model.halt_predictor.weight",
        "model.null_group",
        "model.boundary_predictor.dense.weight",
        "model.residual_proj.weight",
    } <= set(legacy)
    save_file(legacy, tmp_path / "model.safetensors", metadata={"format": "pt"})

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, key_mapping=LEGACY_KEY_MAPPING)
    state = loaded.state_dict()
    assert set(state) == set(current)
    for name, tensor in current.items():
        assert torch.equal(state[name], tensor), name
