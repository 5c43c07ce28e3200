"""Older releases (routed experts as one ``nn.Linear`` SwiGLU each: ``...mlp.experts.{e}.gate_proj
.weight``, ``up_proj.weight``, ``down_proj.weight``; ``config.json`` with ``moe_implementation``) load into the fused
experts (``...mlp.experts.gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I)) with the same weights, so the same
outputs: through ``from_pretrained`` (the conversion registered for model type ``"spider"``), through
``trust_remote_code``, and through ``load_state_dict`` (a Trainer resuming from an old checkpoint).

The old layout is written here by hand from the fused weights (not with transformers' reverse conversion), so the test
does not check the conversion against itself.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from modeling_spider import SpiderForConditionalGeneration
from spider_training.checkpointing import convert_older_checkpoint, fuse_per_expert_state_dict
from tests.helpers import per_expert_state_dict, tiny_model


@pytest.fixture(scope="module")
def old_release(tmp_path_factory):
    """A release folder in the old layout: per-expert safetensors keys, ``moe_implementation: "sorted"`` in
    config.json; with the model whose weights it holds."""
    folder = tmp_path_factory.mktemp("old-release")
    model = tiny_model(seed=0).eval()
    model.save_pretrained(folder)  # config.json and the modeling files (trust_remote_code)
    save_file(per_expert_state_dict(model.state_dict()), str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["moe_implementation"] = "sorted"
    (folder / "config.json").write_text(json.dumps(config))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "model.recurrent_block.layers.0.mlp.experts.7.up_proj.weight" in f.keys()
        assert not any(k.endswith("gate_up_proj") for k in f.keys())
    return folder, model


def _ids():
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("remote_code", [False, True])
def test_old_release_loads_with_equal_weights_and_outputs(old_release, remote_code):
    folder, model = old_release
    if remote_code:
        loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(loaded).__module__ != SpiderForConditionalGeneration.__module__  # the release's own copy
    else:
        loaded = SpiderForConditionalGeneration.from_pretrained(folder).eval()
    assert loaded.config._experts_implementation == "grouped_mm"  # moe_implementation="sorted", mapped
    state, expected = loaded.state_dict(), model.state_dict()
    assert state.keys() == expected.keys()
    for key in expected:
        assert torch.equal(state[key], expected[key]), key
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_old_config_eager_maps_to_eager(old_release, tmp_path):
    folder, _ = old_release
    config = json.loads((folder / "config.json").read_text())
    config["moe_implementation"] = "eager"
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert SpiderForConditionalGeneration.from_pretrained(tmp_path).config._experts_implementation == "eager"
    # an explicit choice at load wins over the old field
    loaded = SpiderForConditionalGeneration.from_pretrained(tmp_path, experts_implementation="batched_mm")
    assert loaded.config._experts_implementation == "batched_mm"


def test_an_old_trainer_checkpoint_is_converted_once_for_resume(old_release, tmp_path):
    """Trainer's resume reads ``model.safetensors`` with ``load_state_dict``, which knows only today's names: a
    checkpoint in the old expert layout, with the segmentation's older names (``null_group``, ``down_norm``,
    ``upsample_norm``), is rewritten first, once (``SpiderTrainer._load_from_checkpoint``)."""
    folder, model = old_release
    checkpoint = tmp_path / "checkpoint-7"
    checkpoint.mkdir()
    older_names = {"null_segment": "null_group", "pool_norm": "down_norm", "expand_norm": "upsample_norm"}
    state = load_file(folder / "model.safetensors")
    for new, old in older_names.items():
        state = {key.replace(f"flexitokens.{new}", f"flexitokens.{old}"): value for key, value in state.items()}
    assert {"model.flexitokens.null_group", "model.flexitokens.down_norm.weight"} <= set(state)
    save_file(state, checkpoint / "model.safetensors", metadata={"format": "pt"})
    assert convert_older_checkpoint(checkpoint)
    assert not convert_older_checkpoint(checkpoint)  # already converted: left alone
    fresh = tiny_model(seed=1)
    result = fresh.load_state_dict(load_file(checkpoint / "model.safetensors"))  # strict
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert not convert_older_checkpoint(tmp_path)  # no weights file


def test_save_writes_fused_keys_and_the_old_layout_on_request(tmp_path):
    model = tiny_model(seed=0).eval()
    model.save_pretrained(tmp_path / "fused")
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(model.state_dict())
    model.save_pretrained(tmp_path / "old", save_original_format=True)  # older releases' layout and names
    older_names = {"null_segment": "null_group", "pool_norm": "down_norm", "expand_norm": "upsample_norm"}
    expected = set(per_expert_state_dict(model.state_dict()))
    for new, old in older_names.items():
        expected = {key.replace(f"flexitokens.{new}", f"flexitokens.{old}") for key in expected}
    with safe_open(str(tmp_path / "old" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == expected
    reloaded = SpiderForConditionalGeneration.from_pretrained(tmp_path / "old")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_fuse_per_expert_state_dict_rules():
    gate, up, down = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 4, 3)
    state = {"a.router.weight": torch.zeros(1)}
    for e in range(2):
        state |= {
            f"a.experts.{e}.gate_proj.weight": gate[e],
            f"a.experts.{e}.up_proj.weight": up[e],
            f"a.experts.{e}.down_proj.weight": down[e],
        }
    state["a.shared_experts.gate_proj.weight"] = torch.ones(1)  # not a routed expert: kept
    fused = fuse_per_expert_state_dict(state)
    assert list(fused) == [
        "a.router.weight",
        "a.experts.gate_up_proj",
        "a.experts.down_proj",
        "a.shared_experts.gate_proj.weight",
    ]
    assert torch.equal(fused["a.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
    assert torch.equal(fused["a.experts.down_proj"], down)
    del state["a.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"a\.experts\.1\.up_proj\.weight"):
        fuse_per_expert_state_dict(state)
