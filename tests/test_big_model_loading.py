"""Big-model loading: ``device_map="auto"`` with CPU + disk offload, and bf16 loads.

accelerate's offload hooks load a module's weights when *that module's* forward runs, so the model may read no
parameter outside the module that owns it (the loop embedding, the FlexiTokens null segment and the stacked
``grouped_mm`` expert weights did, and gave "Tensor on device meta" errors; the fused experts read theirs inside
``SpiderExperts.forward`` whatever the experts implementation).
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import float_tol, model_terms, tiny_model


@pytest.fixture(scope="module", params=["eager", "grouped_mm"])
def release(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"release-{request.param}")
    model = tiny_model(seed=0, experts_implementation=request.param).eval()
    model.save_pretrained(folder)
    return folder, model


def _ids():
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("max_memory", ["300KB", "1MB"])  # everything on disk / part in memory, part on disk
def test_cpu_and_disk_offload_give_the_plain_logits_and_generation(release, max_memory, tmp_path):
    folder, model = release
    offloaded = AutoModelForCausalLM.from_pretrained(
        folder,
        trust_remote_code=True,
        device_map="auto",
        max_memory={"cpu": max_memory},
        offload_folder=str(tmp_path / "offload"),
        experts_implementation=model.config._experts_implementation,
    ).eval()
    assert offloaded.config._experts_implementation == model.config._experts_implementation
    assert "disk" in set(offloaded.hf_device_map.values())
    ids = _ids()
    with torch.no_grad():
        expected, got = model(ids).logits, offloaded(ids).logits
    torch.testing.assert_close(got, expected, **float_tol(expected, model_terms(model)))
    greedy = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(offloaded.generate(ids[:1, :10], **greedy), model.generate(ids[:1, :10], **greedy))


def test_bfloat16_load(release):
    folder, model = release
    bf16 = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.bfloat16).eval()
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.lm_head.weight.dtype == torch.float32  # _keep_in_fp32_modules_strict
    ids = _ids()
    with torch.no_grad():
        expected, got = model(ids).logits, bf16(ids).logits
    # bf16 roundoff accumulates like a random walk over the terms that feed a logit: eps * sqrt(terms), 4 sigma
    rtol = 4 * torch.finfo(torch.bfloat16).eps * math.sqrt(model_terms(model))
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=rtol * float(expected.abs().max()))
    assert bf16.generate(ids[:1, :10], max_new_tokens=4, do_sample=False).shape == (1, 14)
