"""FSDP2 on CPU: the shipped accelerate config's sharding, trained by two gloo processes.

One ``accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2`` runs
``tests/fsdp2_worker.py`` (what each process does is described there); this file checks what it wrote.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import float_tol, model_terms, run_fresh_python, tiny

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs/accelerate/fsdp2.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(_free_port()),
        str(REPO / "tests/fsdp2_worker.py"),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, json.loads((out / "rank0.json").read_text())


def _loss_tol(losses: list[float], steps: int) -> dict:
    """Two runs that differ only in where gradients are summed (one process, or a reduce-scatter over ranks): the
    float32 roundoff of a whole-model forward (:func:`float_tol`), once per optimizer step that feeds the next loss."""
    return float_tol(torch.tensor(losses), terms=model_terms(SimpleNamespace(config=tiny())) * steps)


@pytest.mark.slow
def test_fsdp2_shards_every_parameter_and_matches_one_process(fsdp_run):
    _, r = fsdp_run
    assert r["world_size"] == 2
    assert r["state_dict_type"].endswith("SHARDED_STATE_DICT")
    assert r["dtensor_parameters"] == r["parameters"] > 0
    # one unit per byte layer and per recurrent layer (the config's wrap policy), the embedding and the head's tail
    assert r["sharded_units"].count("FSDPSpiderDecoderLayer") == 2
    assert r["sharded_units"].count("FSDPSpiderRecurrentLayer") == 2
    steps = len(r["fsdp_losses"])
    torch.testing.assert_close(
        torch.tensor(r["fsdp_losses"]), torch.tensor(r["reference_losses"]), **_loss_tol(r["reference_losses"], steps)
    )
    # training moved the weights (the comparison is not of two untrained models)
    assert r["fsdp_losses"][-1] != r["fsdp_losses"][0]


@pytest.mark.slow
def test_fsdp2_activation_checkpointing_gives_the_same_curve(fsdp_run):
    _, r = fsdp_run
    torch.testing.assert_close(
        torch.tensor(r["checkpointed_losses"]),
        torch.tensor(r["fsdp_losses"]),
        **_loss_tol(r["fsdp_losses"], len(r["fsdp_losses"])),
    )


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_resumes_the_same_curve(fsdp_run):
    _, r = fsdp_run
    assert r["checkpoint_files"] == ["optimizer_0", "pytorch_model_fsdp_0"]  # accelerate's SHARDED_STATE_DICT layout
    assert len(r["resumed_losses"]) == len(r["continued_losses"]) == 2
    torch.testing.assert_close(
        torch.tensor(r["resumed_losses"]), torch.tensor(r["continued_losses"]), **_loss_tol(r["continued_losses"], 1)
    )


@pytest.mark.slow
def test_fsdp2_with_compiled_layers_gives_the_same_curve(fsdp_run):
    """`--compile`'s layers (`spider_training.compile.compile_model`, dynamo's `eager` backend: its tracing and guards)
    compiled before FSDP2 shards them: three graphs (byte, recurrent, recurrent with Engram) serve every step, and the
    loss curve is the uncompiled sharded one."""
    _, r = fsdp_run
    assert r["compiled_graphs"] == 3, r["compiled_graphs"]
    torch.testing.assert_close(
        torch.tensor(r["compiled_losses"]),
        torch.tensor(r["fsdp_losses"]),
        **_loss_tol(r["fsdp_losses"], len(r["fsdp_losses"])),
    )


@pytest.mark.slow
def test_fsdp2_emulated_fp8_shards_and_trains(fsdp_run):
    """torchao Float8Linear weights become DTensors and train to the single-process curve. Emulated FP8 rounds to
    e4m3's 3 mantissa bits: a last-bit difference in a weight can move one quantised element by a whole e4m3 step
    (2^-3 relative), so the bound is 2^-3 over the hidden size per step, not float32's roundoff."""
    _, r = fsdp_run
    assert r["fp8_converted"] > 0 and r["fp8_dtensor_weights"] == r["fp8_converted"]
    steps = len(r["fp8_losses"])
    rtol = 2.0**-3 / tiny().hidden_size * steps
    torch.testing.assert_close(
        torch.tensor(r["fp8_losses"]),
        torch.tensor(r["fp8_reference_losses"]),
        rtol=rtol,
        atol=rtol * max(r["fp8_reference_losses"]),
    )


@pytest.mark.slow
def test_fsdp2_gathered_release_loads_with_remote_code(fsdp_run, tmp_path):
    """spider_training.release.gather_unsharded (what train_hf.py calls on every rank before rank 0 writes the release)
    gives rank 0 a plain model, also from the FP8 model; its release loads in a fresh process with trust_remote_code
    and gives the sharded model's logits."""
    out, r = fsdp_run
    assert r["release_has_dtensors"] is False and r["fp8_release_plain"] is True
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
        "probe = torch.load(sys.argv[2])\n"
        "with torch.no_grad():\n"
        "    logits = m(input_ids=probe['input_ids']).logits\n"
        "torch.save(logits, sys.argv[3])\n"
    )
    run_fresh_python(code, str(out / "release"), str(out / "probe.pt"), str(tmp_path / "logits.pt"), workdir=tmp_path)
    sharded = torch.load(out / "probe.pt")["logits"]
    loaded = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(loaded, sharded, **float_tol(sharded, model_terms(SimpleNamespace(config=tiny()))))
