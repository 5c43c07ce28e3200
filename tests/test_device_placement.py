"""Every path that builds tensors for the model builds them on the model's device (a CUDA crash found on a GPU:
``spider_training.commands.generate.sample`` built the prompt on the CPU for a model on ``cuda:0``).

On a CPU-only machine the model and the default device are the same, so a tensor built without naming a device
cannot be told apart. The test double here, :func:`default_device_elsewhere`, makes them differ: inside it the
*default* device is ``meta`` while the model stays on the CPU, exactly as on a GPU the default device (CPU) differs
from the model's (``cuda:0``). A tensor a code path builds without asking for ``model.device`` lands on ``meta``, and
the forward pre-hook of :func:`inputs_on_model_device` stops the forward with a message naming the argument. The
real code paths (tokenizer, ``generate``, held-out scoring) run unchanged inside it.

The CUDA-only test at the end runs the main job itself for a few steps on the GPU (skipped without CUDA).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from spider_training.commands.generate import sample
from spider_training.metrics import bits_per_byte
from tests.helpers import tiny_model
from tokenization_spider import SpiderTokenizer


class InputOnWrongDevice(AssertionError):
    """A tensor argument of the model's forward is not on the device of the model's parameters."""


def _check_inputs(module, args, kwargs):
    device = next(module.parameters()).device
    named = {**{f"positional argument {i}": a for i, a in enumerate(args)}, **kwargs}
    wrong = {name: str(v.device) for name, v in named.items() if isinstance(v, torch.Tensor) and v.device != device}
    if wrong:
        raise InputOnWrongDevice(f"{type(module).__name__}.forward got {wrong}; the model is on {device}")


@contextlib.contextmanager
def inputs_on_model_device(model):
    """A forward pre-hook on `model` that raises :class:`InputOnWrongDevice` for any tensor argument (positional or
    keyword) on another device than the model's parameters."""
    handle = model.register_forward_pre_hook(_check_inputs, with_kwargs=True)
    try:
        yield model
    finally:
        handle.remove()


@contextlib.contextmanager
def default_device_elsewhere(model):
    """The test double of a GPU run (module docstring): default device ``meta``, model on the CPU, inputs checked."""
    with inputs_on_model_device(model), torch.device("meta"):
        yield model


def _sample_as_before_the_fix(model, tokenizer, prompt):
    """The crashing code path, kept to show that the double catches it: the prompt is built on the default device."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, pad_token_id=256)


def test_the_double_catches_a_prompt_built_off_the_model_device():
    model = tiny_model().eval()
    # generate() itself fails on the meta prompt (its special-token checks read a value) or the hook stops the forward
    with default_device_elsewhere(model), pytest.raises((InputOnWrongDevice, RuntimeError), match="meta"):
        _sample_as_before_the_fix(model, SpiderTokenizer(), "Hello")


def test_sample_builds_its_prompt_on_the_model_device():
    model, tokenizer = tiny_model(), SpiderTokenizer()
    expected = sample(model, tokenizer, "Hello", max_new_tokens=6)
    with default_device_elsewhere(model):
        got = sample(model, tokenizer, "Hello", max_new_tokens=6)
    assert got == expected and isinstance(got, str)


def test_held_out_scoring_puts_batches_on_its_device():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}]
    expected = bits_per_byte(model, batches, device="cpu")
    with default_device_elsewhere(model):
        got = bits_per_byte(model, batches, device="cpu")
    assert got == expected


def test_the_hook_reports_the_argument_and_both_devices():
    model = tiny_model()
    with inputs_on_model_device(model), pytest.raises(InputOnWrongDevice) as caught:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))
    assert "'input_ids': 'meta'" in str(caught.value) and "cpu" in str(caught.value)


def test_the_model_names_both_devices_when_input_ids_are_elsewhere():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"input_ids is on meta but the model's embeddings are on cpu"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the main job end to end on a GPU")
def test_main_job_on_cuda_writes_a_release_that_generates_on_cuda(tmp_path):
    """The README's main job for a few steps on CUDA: trains, scores, samples, writes the release; the release loads
    onto the GPU and generates there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import train_hf

    summary = train_hf.main(
        [
            "--preset",
            "tiny",
            "--seq_len",
            "64",
            "--micro_batch",
            "4",
            "--max_steps",
            "4",
            "--eval_windows",
            "4",
            "--sample_bytes",
            "8",
            "--dataloader_num_workers",
            "0",
            "--ckpt_dir",
            str(tmp_path / "run"),
        ]
    )
    assert summary["precision"] == "bf16" and isinstance(summary["sample"], str)
    release = summary["release_dir"]
    model = AutoModelForCausalLM.from_pretrained(release, trust_remote_code=True, device_map="cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(release, trust_remote_code=True)
    assert model.device.type == "cuda"
    with inputs_on_model_device(model):
        text = sample(model, tokenizer, "The state of the Union is", max_new_tokens=8)
    assert isinstance(text, str)
