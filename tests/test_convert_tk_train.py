"""tk-train.py's checkpoints (`spider-stepN.pt` pickles) enter only through
`spider_training.commands.convert_tk_train`.

The checkpoints here are written the way tk-train.py writes them: `torch.save` of its dict, in a
separate process in which the config class really is tk-train.py's (`__main__.SpiderConfig`, or
`tk-spider.SpiderConfig`
imported with `importlib.import_module("tk-spider")` as tk-train.py does), so this process cannot import it.
"""

import json
import os
import pickle
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from configuration_spider import SpiderConfig
from spider_training.commands import convert_tk_train as cs
from spider_training.commands.convert_tk_train import (
    TK_TRAIN_KEY_MAPPING,
    UnsafeCheckpointError,
    convert_tk_train_checkpoint,
    tk_train_to_spider_name,
)
from tests.helpers import REMOTE_CODE_FILES, per_expert_state_dict, tiny_model

REPO = Path(__file__).resolve().parents[1]

# tk-train.py's config class. Its shape is a guess (its model file, tk-spider.py, is not public): SpiderConfig
# field names, OpenMythos-style aliases (dim, prelude_layers, n_experts, ...) and two fields with no counterpart.
TK_TRAIN_CFG_CLASS = """
from dataclasses import dataclass, field

@dataclass
class SpiderConfig:
    vocab_size: int = 272
    dim: int = 64
    intermediate_size: int = 128
    n_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16
    prelude_layers: int = 1
    num_recurrent_layers: int = 2
    coda_layers: int = 1
    n_experts: int = 8
    n_experts_per_tok: int = 2
    expert_dim: int = 32
    engram_layer_ids: tuple = (1,)
    engram_num_heads: int = 2
    engram_head_dim: int = 16
    engram_table_size: int = 257
    n_loops: int = 3
    max_loop_iters: int = 4
    lora_rank: int = 16
    max_seq_len: int = 512
    use_tile_kernels: bool = True
    fp8_recipe: str = "tensorwise"

    def __setstate__(self, state):  # runs only if something imports and executes this class while loading
        open(MARKER, "w").close()
        self.__dict__.update(state)
"""

# Writes two checkpoints the way tk-train.py's save_step_checkpoint does.
TK_TRAIN_WRITER = r"""
import importlib, os, sys
import torch
from safetensors.torch import load_file

ckpt_dir, state_file = sys.argv[1], sys.argv[2]
MARKER = os.path.join(ckpt_dir, "tk_train_code_ran")
exec(open(os.path.join(ckpt_dir, "tk_train_cfg.py")).read())          # SpiderConfig defined in __main__
sys.path.insert(0, ckpt_dir)
tk_spider = importlib.import_module("tk-spider")                   # as tk-train.py line 55
assert SpiderConfig.__module__ == "__main__" and tk_spider.SpiderConfig.__module__ == "tk-spider"

state = load_file(state_file)
opt_param = torch.nn.Parameter(torch.randn(8, 4))
optimizer = torch.optim.AdamW([opt_param], lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True, eps=1e-8)
opt_param.grad = torch.randn(8, 4)
optimizer.step()

def save(path, model_state, cfg):
    tmp_path = path + ".tmp"
    torch.save({
        "step": 50, "epoch": 0,
        "model_state_dict": model_state,
        "optimizer_state_dict": optimizer.state_dict(),
        "cfg": cfg, "best_loss": float("inf"),
    }, tmp_path)
    os.replace(tmp_path, path)

# 1) config class in __main__, fp32, plain keys
save(os.path.join(ckpt_dir, "spider-step50-main.pt"), dict(state), SpiderConfig())
# 2) like tk-train.py: tk-spider.SpiderConfig, model.to(bf16), DDP(torch.compile(model)) key prefixes
wrapped = {"module._orig_mod." + k: v.to(torch.bfloat16) for k, v in state.items()}
save(os.path.join(ckpt_dir, "spider-step50-tk.pt"), wrapped, tk_spider.SpiderConfig())
"""

LOADER = r"""
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
results = {}
assert not any("modeling_spider" in m for m in sys.modules)
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok(["Four score and seven years ago"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    on_disk = load_file(folder + "/model.safetensors")
    state = model.state_dict()
    results[folder] = {
        "class": type(model).__name__, "module": type(model).__module__,
        "n_loops": model.config.n_loops, "dtype": str(model.model.embed_tokens.weight.dtype),
        "logits_dtype": str(logits.dtype),
        "logits_shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
        # the modules the model keeps in fp32 (lm_head, router, predictors) hold the file's values exactly
        "weights_equal_file": all(torch.equal(state[k].to(v.dtype), v) for k, v in on_disk.items())
        and set(state) == set(on_disk),
    }
print(json.dumps(results))
"""

#: tk-train.py's names for Spider's keys, as TK_TRAIN_KEY_MAPPING documents them (its inverse, test-only: the
#: tk-train.py-format
#: checkpoints below are written under these names).
TO_TK_TRAIN_NAMES = {
    r"^model\.prelude_layers\.(\d+)\.": r"model.prelude.\1.",
    r"^model\.recurrent_block\.layers\.(\d+)\.": r"model.recurrent_layers.\1.",
    r"^model\.coda_layers\.(\d+)\.": r"model.coda.\1.",
    r"^model\.flexitokens\.boundary_predictor\.dense\.": "model.boundary_predictor.0.",
    r"^model\.flexitokens\.boundary_predictor\.out_proj\.": "model.boundary_predictor.2.",
    r"^model\.flexitokens\.null_segment$": "model.null_group",
    r"^model\.flexitokens\.pool_norm\.": "model.down_norm.",
    r"^model\.flexitokens\.expand_norm\.": "model.upsample_norm.",
    r"^model\.(?:recurrent_block|flexitokens)\.": "model.",
}


def spider_to_tk_train_name(key: str) -> str:
    for pattern, replacement in TO_TK_TRAIN_NAMES.items():
        key = re.sub(pattern, replacement, key)
    return key


UNKNOWN_KEY = "model.rope.inv_freq"  # a buffer tk-train.py may have saved; Spider computes RoPE on the fly
MISSHAPED_MODEL_KEY = "model.recurrent_block.layers.0.mlp.router.weight"


def _clean_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp / "hf_modules")
    env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.fixture(scope="module")
def tk_train(tmp_path_factory):
    """Two tk-train.py checkpoints and the tensors they hold (Spider names -> tensor)."""
    tmp = tmp_path_factory.mktemp("tk_train")
    ours = {k: v.clone() for k, v in tiny_model(seed=3, n_loops=3).state_dict().items()}
    # tk-train.py's routed experts are one nn.Linear SwiGLU each: per-expert keys, which the conversion fuses
    checkpoint_state = {spider_to_tk_train_name(k): v for k, v in per_expert_state_dict(ours).items()}
    checkpoint_state[UNKNOWN_KEY] = torch.arange(8, dtype=torch.float32)
    bad = spider_to_tk_train_name(MISSHAPED_MODEL_KEY)
    checkpoint_state[bad] = torch.randn(9, ours[MISSHAPED_MODEL_KEY].shape[1])
    save_file(checkpoint_state, tmp / "checkpoint_state.safetensors")
    (tmp / "tk_train_cfg.py").write_text(TK_TRAIN_CFG_CLASS)
    (tmp / "tk-spider.py").write_text(
        "import os\nMARKER = os.path.join(os.path.dirname(__file__), 'tk_train_code_ran')\n" + TK_TRAIN_CFG_CLASS
    )
    script = tmp / "write_tk_train.py"
    script.write_text(TK_TRAIN_WRITER)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp), str(tmp / "checkpoint_state.safetensors")],
        cwd=tmp,
        env=_clean_env(tmp),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp / "tk_train_code_ran").exists()
    return {
        "dir": tmp,
        "ours": ours,
        "checkpoint_state": checkpoint_state,
        "misshaped_checkpoint_key": bad,
        "main": tmp / "spider-step50-main.pt",
        "tk": tmp / "spider-step50-tk.pt",
    }


def test_name_rules_round_trip_every_spider_key():
    keys = list(tiny_model().state_dict())
    keys += [k for k in tiny_model(expand_mixing="residual_proj").state_dict() if k not in keys]  # + residual_proj
    ckpt_names = [spider_to_tk_train_name(k) for k in keys]
    assert [tk_train_to_spider_name(n) for n in ckpt_names] == keys
    assert [tk_train_to_spider_name("module._orig_mod." + n) for n in ckpt_names] == keys
    assert len(set(ckpt_names)) == len(keys)
    # every rename pattern (after the two wrapper patterns) is used by some checkpoint name
    renamed = {n for n, k in zip(ckpt_names, keys) if n != k}
    for pattern in list(TK_TRAIN_KEY_MAPPING)[2:]:
        assert any(re.search(pattern, n) for n in renamed), pattern
    # our own names are accepted too (identity), FSDP / checkpoint wrappers anywhere drop out, and extra rules apply
    ours = "model.recurrent_block.layers.1.engram.key_proj.weight"
    assert tk_train_to_spider_name(ours) == ours
    assert (
        tk_train_to_spider_name(
            "module.model._fsdp_wrapped_module.recurrent_layers.1._checkpoint_wrapped_module.engram.key_proj.weight"
        )
        == ours
    )
    assert (
        tk_train_to_spider_name("model.halt.weight", {r"^model\.halt\.": "model.recurrent_block.halt_predictor."})
        == "model.recurrent_block.halt_predictor.weight"
    )
    extra = dict([cs.parse_key_mapping(r"^blocks\.(\d+)\.ffn\.=model.recurrent_block.layers.\1.mlp.")])
    assert (
        tk_train_to_spider_name("blocks.3.ffn.router.weight", extra)
        == "model.recurrent_block.layers.3.mlp.router.weight"
    )
    for bad in ["no_equals_sign", "=model.x.", "a(b=c"]:
        with pytest.raises(ValueError, match="rename rule"):
            cs.parse_key_mapping(bad)


@pytest.mark.parametrize("variant", ["main", "tk"])
def test_convert_maps_tensors_and_reports_the_rest(tk_train, variant, tmp_path, monkeypatch, capsys):
    # A loader that imported tk-train.py's class could find tk-spider.py here; the weights-only one must not run it.
    monkeypatch.syspath_prepend(str(tk_train["dir"]))
    out = tmp_path / "release"
    report = convert_tk_train_checkpoint(tk_train[variant], out, preset="tiny")
    assert not (tk_train["dir"] / "tk_train_code_ran").exists()
    assert "tk-spider" not in sys.modules

    prefix = "module._orig_mod." if variant == "tk" else ""
    expected_dtype = torch.bfloat16 if variant == "tk" else torch.float32
    assert report["cfg_global"] == ("tk-spider.SpiderConfig" if variant == "tk" else "__main__.SpiderConfig")
    assert (report["step"], report["epoch"], report["best_loss"]) == (50, 0, "inf")
    assert report["dtype"] == str(expected_dtype).removeprefix("torch.")
    assert report["unmapped_checkpoint_keys"] == [prefix + UNKNOWN_KEY]
    assert report["shape_mismatches"] == [
        {
            "checkpoint_key": prefix + tk_train["misshaped_checkpoint_key"],
            "model_key": MISSHAPED_MODEL_KEY,
            "checkpoint_shape": [9, 64],
            "model_shape": [8, 64],
        }
    ]
    assert report["missing_model_keys"] == [MISSHAPED_MODEL_KEY]
    assert report["mapped"] == len(tk_train["ours"]) - 1 == report["model_keys"] - 1
    assert report["complete"] is False
    assert (
        report["renamed"][f"{prefix}model.recurrent_layers.0.self_attn.o_proj.weight"]
        == "model.recurrent_block.layers.0.self_attn.o_proj.weight"
    )
    assert (prefix + "lm_head.weight") not in report["renamed"]  # only wrappers differ: counted, not listed
    # every checkpoint key that mapped carried the wrappers: all but the unknown and the misshaped one
    assert report["unwrapped"] == (len(tk_train["checkpoint_state"]) - 2 if prefix else 0)
    # tk-train.py's per-expert weights went into the fused experts
    for proj, fused in (("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj"), ("down_proj", "down_proj")):
        assert (
            report["renamed"][f"{prefix}model.recurrent_layers.0.mlp.experts.3.{proj}.weight"]
            == f"model.recurrent_block.layers.0.mlp.experts.{fused}"
        )
    # cfg: names and aliases read from the pickled object; fields with no counterpart reported
    assert report["cfg_fields_used"]["dim"] == "hidden_size"
    assert report["cfg_fields_used"]["n_experts"] == "n_routed_experts"
    assert report["cfg_fields_used"]["n_loops"] == "n_loops"
    assert set(report["cfg_fields_ignored"]) == {"use_tile_kernels", "fp8_recipe"}
    json.dumps(report)  # serialisable as printed by the CLI

    # files: safetensors only, plus the config/code/tokenizer and the report
    files = set(os.listdir(out))
    assert {
        "model.safetensors",
        "config.json",
        *REMOTE_CODE_FILES,
        "tokenizer_config.json",
        "tk_train_conversion.json",
    } <= files
    assert not any(f.endswith((".pt", ".bin", ".pkl", ".pth")) for f in files)
    assert json.loads((out / "tk_train_conversion.json").read_text())["mapped"] == report["mapped"]

    # mapped tensors equal the originals, bit for bit, in the checkpoint's dtype
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(tk_train["ours"])
    for key, original in tk_train["ours"].items():
        if key == MISSHAPED_MODEL_KEY:
            continue
        assert saved[key].dtype == expected_dtype, key
        assert torch.equal(saved[key], original.to(expected_dtype)), key
    assert saved[MISSHAPED_MODEL_KEY].shape == (8, 64)

    # the config comes from tk-train.py's cfg object (n_loops=3 differs from the tiny preset's 2)
    config = json.loads((out / "config.json").read_text())
    reference = SpiderConfig.from_preset("tiny", n_loops=3).to_dict()
    for field in (
        "hidden_size",
        "num_attention_heads",
        "num_prelude_layers",
        "num_recurrent_layers",
        "num_coda_layers",
        "n_routed_experts",
        "moe_intermediate_size",
        "engram_layer_ids",
        "n_loops",
        "max_position_embeddings",
    ):
        assert config[field] == reference[field], field


def test_cli_release_loads_with_auto_classes_in_a_fresh_process(tk_train, tmp_path, capsys):
    """The command line's release (its entry point called in-process; ``python -m`` only adds ``sys.exit``) and the
    function's fp32 release both load with the Auto classes in a fresh process, from their own code."""
    cli_out = tmp_path / "cli_release"
    assert cs.main([str(tk_train["tk"]), str(cli_out), "--preset", "tiny"]) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert report["unmapped_checkpoint_keys"] == ["module._orig_mod." + UNKNOWN_KEY]
    assert report["mapped"] == len(tk_train["ours"]) - 1
    assert "incomplete mapping" in printed.err

    fp32_out = tmp_path / "fp32_release"
    convert_tk_train_checkpoint(tk_train["main"], fp32_out, preset="tiny")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    load = subprocess.run(
        [sys.executable, "-c", LOADER, str(cli_out), str(fp32_out)],
        cwd=elsewhere,
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert load.returncode == 0, load.stderr[-3000:]
    results = json.loads(load.stdout.strip().splitlines()[-1])
    for folder, dtype in ((cli_out, "torch.bfloat16"), (fp32_out, "torch.float32")):
        got = results[str(folder)]
        assert got["class"] == "SpiderForConditionalGeneration"
        assert got["module"].startswith("transformers_modules."), got["module"]
        assert got["n_loops"] == 3
        assert got["dtype"] == dtype
        assert got["logits_dtype"] == "torch.float32"  # lm_head stays fp32 in a bf16 load (_keep_in_fp32_modules)
        assert got["logits_shape"] == [1, 32, 272]
        assert got["finite"] is True
        assert got["weights_equal_file"] is True


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    """The command's entry point (``spider-convert-tk-train`` exits with what it returns; the
    ``-m`` runs are test_cli_release_loads_with_auto_classes_in_a_fresh_process's) on a missing file: status 1 and one
    line naming it, no traceback."""
    missing = tmp_path / "spider-step404.pt"
    assert cs.main([str(missing), str(tmp_path / "out")]) == 1
    stderr = capsys.readouterr().err
    assert str(missing) in stderr and "does not exist" in stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


class Pwn:
    """A pickle payload: unpickling it would run `touch <target>`."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


@pytest.mark.parametrize("how", ["torch_zip", "torch_legacy", "raw_pickle"])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path, how):
    pwned = tmp_path / "pwned"
    ckpt = tmp_path / "spider-step50.pt"
    payload = {"model_state_dict": {"model.norm.weight": torch.ones(4)}, "cfg": Pwn(pwned), "step": 50}
    if how == "torch_zip":
        torch.save(payload, ckpt)
    elif how == "torch_legacy":
        torch.save(payload, ckpt, _use_new_zipfile_serialization=False)
    else:  # plain pickle (no tensors: plain pickle would store them through another non-allowlisted global)
        payload["model_state_dict"] = {}
        ckpt.write_bytes(pickle.dumps(payload, protocol=2))
    assert not pwned.exists()
    with pytest.raises(UnsafeCheckpointError) as info:
        convert_tk_train_checkpoint(ckpt, tmp_path / "out", preset="tiny")
    message = str(info.value)
    assert str(ckpt) in message
    assert "posix.system" in message or "os.system" in message
    assert not pwned.exists()
    assert not (tmp_path / "out").exists()


class NotTheTkTrainConfig:
    """A harmless class that is simply not on the allowlist."""

    def __init__(self):
        self.hidden_size = 64


def test_global_not_on_the_allowlist_is_refused(tmp_path):
    ckpt = tmp_path / "spider-step50.pt"
    torch.save({"model_state_dict": {}, "cfg": NotTheTkTrainConfig()}, ckpt)
    with pytest.raises(UnsafeCheckpointError, match="NotTheTkTrainConfig") as info:
        convert_tk_train_checkpoint(ckpt, tmp_path / "out", preset="tiny")
    assert str(ckpt) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_missing_file_garbage_and_wrong_layout_are_clear_errors(tmp_path):
    out = tmp_path / "out"
    missing = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_tk_train_checkpoint(missing, out)

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint\x00\x01\x02" * 10)
    with pytest.raises(ValueError, match="not a torch checkpoint") as info:
        convert_tk_train_checkpoint(garbage, out)
    assert str(garbage) in str(info.value)

    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        convert_tk_train_checkpoint(empty, out)

    other_zip = tmp_path / "other.pt"
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("readme.txt", "hello")
    with pytest.raises(ValueError, match="without data.pkl"):
        convert_tk_train_checkpoint(other_zip, out)

    with pytest.raises(ValueError, match="is not a file"):
        convert_tk_train_checkpoint(tmp_path, out)

    no_state = tmp_path / "no_state.pt"
    torch.save({"step": 50, "epoch": 0, "cfg": None, "best_loss": 1.0}, no_state)
    with pytest.raises(ValueError, match="no 'model_state_dict'") as info:
        convert_tk_train_checkpoint(no_state, out)
    assert str(no_state) in str(info.value) and "best_loss" in str(info.value)

    bare = tmp_path / "bare.pt"
    torch.save(torch.zeros(3), bare)
    with pytest.raises(ValueError, match="holds a Tensor"):
        convert_tk_train_checkpoint(bare, out)
    assert not out.exists()


def test_invalid_tk_train_cfg_and_occupied_output_are_refused(tk_train, tmp_path):
    bad_cfg = tmp_path / "bad_cfg.pt"
    torch.save({"model_state_dict": {}, "cfg": {"hidden_size": 64, "n_experts": 2, "num_experts_per_tok": 4}}, bad_cfg)
    with pytest.raises(ValueError, match="num_experts_per_tok") as info:
        convert_tk_train_checkpoint(bad_cfg, tmp_path / "out", preset="tiny")
    assert str(bad_cfg) in str(info.value)

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_tk_train_checkpoint(tk_train["main"], occupied, preset="tiny")
    assert (occupied / "keep.txt").read_text() == "mine"

    with pytest.raises(ValueError, match="strict"):
        convert_tk_train_checkpoint(tk_train["main"], tmp_path / "strict_out", preset="tiny", strict=True)
    assert not (tmp_path / "strict_out").exists()


def test_tk_train_cfg_that_is_a_transformers_config_is_read_as_data(tmp_path):
    """tk-train.py calls `gradient_checkpointing_enable()` on its model, so its SpiderConfig may well be a transformers
    config subclass: its pickled __dict__ (with transformers' bookkeeping fields) is read the same way."""
    import types

    from transformers import PreTrainedConfig

    module = types.ModuleType("tk-spider")

    class TkTrainHFConfig(PreTrainedConfig):
        model_type = "tk_train_spider"

        def __init__(self, hidden_size=64, n_experts=8, n_loops=5, **kwargs):
            self.hidden_size, self.n_experts, self.n_loops = hidden_size, n_experts, n_loops
            super().__init__(**kwargs)

    TkTrainHFConfig.__module__ = "tk-spider"
    TkTrainHFConfig.__name__ = TkTrainHFConfig.__qualname__ = "SpiderConfig"
    module.SpiderConfig = TkTrainHFConfig
    sys.modules["tk-spider"] = module
    try:
        ckpt = tmp_path / "spider-step50.pt"
        torch.save({"model_state_dict": {}, "cfg": TkTrainHFConfig(), "step": 50}, ckpt)
    finally:
        del sys.modules["tk-spider"]
    assert "tk-spider.SpiderConfig" in torch.serialization.get_unsafe_globals_in_checkpoint(str(ckpt))

    report = convert_tk_train_checkpoint(ckpt, tmp_path / "out", preset="tiny")
    assert report["cfg_global"] == "tk-spider.SpiderConfig"
    assert report["cfg_fields_used"] == {
        "hidden_size": "hidden_size",
        "n_experts": "n_routed_experts",
        "n_loops": "n_loops",
    }
    assert {"return_dict", "transformers_version", "id2label"} <= set(report["cfg_fields_ignored"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["n_loops"] == 5
    # nothing mapped: every model key is reported missing
    assert report["mapped"] == 0 and len(report["missing_model_keys"]) == report["model_keys"]


def test_map_state_dict_bare_trunk_keys_duplicates_and_non_tensors():
    model_state = tiny_model().state_dict()
    checkpoint_state = {
        "embed_tokens.weight": torch.zeros(272, 64),  # trunk saved without `model.`
        "model.recurrent_layers.1.engram.key_proj.weight": torch.ones(64, 64),
        # the same target under our own name
        "model.recurrent_block.layers.1.engram.key_proj.weight": torch.full((64, 64), 2.0),
        "model.recurrent_block.loop_lora.lora_A": torch.zeros(16, 64),
        "lm_head.weight": torch.zeros(272, 64),
        "_extra_state": {"fp8": "metadata"},  # not a tensor
    }
    mapped, details = cs.map_state_dict(checkpoint_state, model_state)
    assert set(mapped) == {
        "model.embed_tokens.weight",
        "model.recurrent_block.layers.1.engram.key_proj.weight",
        "model.recurrent_block.loop_lora.lora_A",
        "lm_head.weight",
    }
    first_wins = mapped["model.recurrent_block.layers.1.engram.key_proj.weight"]
    assert torch.equal(first_wins, torch.ones(64, 64))
    assert details["duplicate_checkpoint_keys"] == ["model.recurrent_block.layers.1.engram.key_proj.weight"]
    assert details["unmapped_checkpoint_keys"] == ["_extra_state"]
    assert details["renamed"] == {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "model.recurrent_layers.1.engram.key_proj.weight": "model.recurrent_block.layers.1.engram.key_proj.weight",
    }
    assert set(details["missing_model_keys"]) == set(model_state) - set(mapped)


def test_map_state_dict_fuses_complete_expert_groups_only():
    """tk-train.py's per-expert weights of a layer fuse into that layer's gate_up_proj / down_proj (equal values); a
    layer whose group misses a weight is not fused: its per-expert keys are reported unmapped, the fused keys
    missing."""
    model_state = tiny_model().state_dict()
    layer0 = "model.recurrent_block.layers.0.mlp.experts."
    layer1 = "model.recurrent_block.layers.1.mlp.experts."
    per_expert = per_expert_state_dict({k: v for k, v in model_state.items() if k.startswith((layer0, layer1))})
    checkpoint_state = {spider_to_tk_train_name(k): v for k, v in per_expert.items()}
    dropped = "model.recurrent_layers.1.mlp.experts.5.up_proj.weight"
    del checkpoint_state[dropped]
    mapped, details = cs.map_state_dict(checkpoint_state, model_state)
    assert set(mapped) == {layer0 + "gate_up_proj", layer0 + "down_proj"}
    assert torch.equal(mapped[layer0 + "gate_up_proj"], model_state[layer0 + "gate_up_proj"])
    assert torch.equal(mapped[layer0 + "down_proj"], model_state[layer0 + "down_proj"])
    assert sorted(details["unmapped_checkpoint_keys"]) == sorted(
        k for k in checkpoint_state if ".recurrent_layers.1." in k
    )
    assert {layer1 + "gate_up_proj", layer1 + "down_proj"} <= set(details["missing_model_keys"])
    assert details["renamed"]["model.recurrent_layers.0.mlp.experts.7.down_proj.weight"] == layer0 + "down_proj"


def test_old_module_name_and_dtype_seed_still_work(tk_train, tmp_path, monkeypatch, capsys, caplog):
    """``python -m spider_training.convert_seed ... --dtype seed`` (the old module and the old name of
    ``--dtype checkpoint``; run here as ``python -m`` runs it, by ``runpy``) still converts, warning that both are
    deprecated; the old import names still resolve."""
    import runpy
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.pop("spider_training.convert_seed", None)
        from spider_training import convert_seed
    assert any("spider_training.commands.convert_tk_train" in str(w.message) for w in caught)
    assert convert_seed.convert_seed_checkpoint is convert_tk_train_checkpoint
    assert convert_seed.seed_to_spider_name is tk_train_to_spider_name
    assert convert_seed.SEED_KEY_MAPPING is TK_TRAIN_KEY_MAPPING

    out = tmp_path / "old_cli"
    monkeypatch.setattr(
        sys, "argv", ["convert_seed", str(tk_train["tk"]), str(out), "--preset", "tiny", "--dtype", "seed"]
    )
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exited:
        warnings.simplefilter("always")
        runpy.run_module("spider_training.convert_seed", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0
    assert any("convert_seed is deprecated" in str(w.message) for w in caught)
    assert "dtype 'seed' is deprecated" in caplog.text
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16"  # the checkpoint's own, as --dtype checkpoint keeps it
    assert (out / "tk_train_conversion.json").is_file()
