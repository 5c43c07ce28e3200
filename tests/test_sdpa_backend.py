"""``--sdpa_backend`` (spider_training/sdpa.py): the kernel SDPA prefers in a training step, seen in the profiler."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.profiler import profile

from spider_training.sdpa import (
    KERNEL_OPS,
    VALUE_PADDED_SDPA,
    attention_for_backend,
    preference_order,
    sdpa_backend_context,
)
from tests.helpers import float_tol, model_terms, tiny, tiny_model


def kernels_run(fn) -> set[str]:
    """The SDPA kernels (``KERNEL_OPS`` names) that `fn()` runs, forward and backward, by the profiler's op names."""
    with profile() as prof:
        fn()
    return {KERNEL_OPS[e.name] for e in prof.events() if e.name in KERNEL_OPS}


def attention_step(q, k, v):
    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out.sum(), (q, k, v))

    return step


def test_the_chosen_kernel_goes_first_then_the_fallbacks_and_the_state_is_restored():
    before = torch._C._get_sdp_priority_order()
    assert preference_order("auto") == [SDPBackend(int(b)) for b in before]
    efficient, math = SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH
    assert preference_order("math") == [math]
    assert preference_order("efficient") == [efficient, math]
    assert preference_order("cudnn") == [SDPBackend.CUDNN_ATTENTION, efficient, math]
    with sdpa_backend_context("cudnn"):
        assert torch._C._get_sdp_priority_order()[:3] == [3, 2, 0]
        assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == before and torch.backends.cuda.flash_sdp_enabled()
    with pytest.raises(ValueError, match="auto, cudnn, flash, efficient, math"):
        preference_order("fast")


def test_math_preference_replaces_the_cpu_flash_kernel():
    """With equal head dims torch's CPU choice is its flash kernel; ``math`` runs the math kernel instead, and so does
    ``efficient``, which CPU lacks: flash is switched off and math is the last fallback."""
    q, k, v = (torch.randn(2, 3, 16, 8, requires_grad=True) for _ in range(3))
    assert kernels_run(attention_step(q, k, v)) == {"flash"}
    for name, kernels in (("math", {"math"}), ("efficient", {"math"}), ("flash", {"flash"})):
        with sdpa_backend_context(name):
            assert kernels_run(attention_step(q, k, v)) == kernels, name


def test_flash_with_mla_head_dims_pads_the_value():
    """MLA's value head dim (16 in tiny) is below the query/key one (32): torch's flash kernel refuses the call and
    SDPA runs math; the value-padded attention runs flash and gives sdpa's logits and gradients."""
    config = tiny()
    assert config.v_head_dim < config.qk_nope_head_dim + config.qk_rope_head_dim
    assert attention_for_backend(config, "flash") == VALUE_PADDED_SDPA
    assert attention_for_backend(config, "cudnn") == attention_for_backend(config, "auto") == "sdpa"
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    results = {}
    for implementation in ("sdpa", VALUE_PADDED_SDPA):
        model = tiny_model(seed=0)
        model.set_attn_implementation(implementation)
        step = {}

        def forward_backward():
            torch.manual_seed(1)
            out = model(ids, labels=ids)
            out.loss.backward()
            step["logits"] = out.logits.detach()

        with sdpa_backend_context("flash"):
            kernels = kernels_run(forward_backward)
        assert kernels == ({"math"} if implementation == "sdpa" else {"flash"}), implementation
        results[implementation] = (step["logits"], model.model.prelude_layers[0].self_attn.kv_b_proj.weight.grad)
    tol = float_tol(results["sdpa"][0], terms=model_terms(tiny_model(seed=0)))
    torch.testing.assert_close(results[VALUE_PADDED_SDPA][0], results["sdpa"][0], **tol)
    torch.testing.assert_close(results[VALUE_PADDED_SDPA][1], results["sdpa"][1], rtol=1e-4, atol=1e-6)


def test_a_backend_needs_sdpa_and_flash_needs_a_value_no_wider_than_the_query():
    config = tiny()
    config._attn_implementation = "eager"
    assert attention_for_backend(config, "auto") == "eager"
    with pytest.raises(ValueError, match="attention is 'eager'"):
        attention_for_backend(config, "math")
    wide = tiny(v_head_dim=64)
    with pytest.raises(ValueError, match="v_head_dim=64, qk_nope_head_dim=16, qk_rope_head_dim=16"):
        attention_for_backend(wide, "flash")


@pytest.mark.parametrize("backend, kernels", [("flash", {"flash"}), ("math", {"math"})])
def test_trainer_steps_run_the_chosen_kernel(tmp_path, backend, kernels):
    from transformers import default_data_collator

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.data import build_dataset
    from spider_training.trainer import SpiderTrainer

    model = tiny_model(seed=0)
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=2,
        remove_unused_columns=False,
        save_strategy="no",
        eval_strategy="no",
        sdpa_backend=backend,
    )
    trainer = SpiderTrainer(
        model=model,
        args=args,
        train_dataset=build_dataset("mock", 32),
        data_collator=default_data_collator,
    )
    assert model.config._attn_implementation == (VALUE_PADDED_SDPA if backend == "flash" else "sdpa")
    assert kernels_run(trainer.train) == kernels
    assert VALUE_PADDED_SDPA not in model.config.to_json_string()  # a release's config names no training-only function
    with pytest.raises(ValueError, match="--sdpa_backend must be one of"):
        SpiderTrainer(model=model, args=dataclasses.replace(args, sdpa_backend="fastest"))


def test_command_line_flag():
    from spider_training.arguments import parse_args

    assert parse_args([]).sdpa_backend == "auto"
    assert parse_args(["--sdpa_backend", "efficient"]).sdpa_backend == "efficient"
    with pytest.raises(ValueError, match="--sdpa_backend must be one of"):
        parse_args(["--sdpa_backend", "xformers"])


def test_measure_sdpa_backends_command_names_the_fastest_kernel_as_a_flag(tmp_path, capsys):
    """``spider-measure-sdpa-backends`` on CPU at toy sizes: its JSON (stdout and ``--out``) has a row per kernel,
    the ones CPU lacks skipped with torch's reason, and stderr names the fastest kernel as an ``--sdpa_backend``
    value; bad sizes are argparse errors."""
    from spider_training.commands import measure_sdpa_backends
    from spider_training.sdpa import SDPA_BACKENDS

    out = tmp_path / "sdpa.json"
    args = ["--preset", "tiny", "--batch", "1", "--segment_counts", "16", "--visits", "2", "--out", str(out)]
    assert measure_sdpa_backends.main(args) == 0
    captured = capsys.readouterr()
    timings = json.loads(captured.out)
    assert json.loads(out.read_text()) == timings and timings["segment_counts"] == [16]
    assert list(timings["backends"]) == list(measure_sdpa_backends.SDPA_BACKENDS)
    assert timings["backends"]["cudnn"]["status"] == "skipped"  # no cuDNN attention on CPU
    assert timings["backends"]["math"]["status"] == "ran" and timings["backends"]["math"]["calls"] == 2
    fastest = timings["fastest_sequence_total"]
    flag = measure_sdpa_backends.KNOB_NAMES.get(fastest, fastest)
    assert flag in SDPA_BACKENDS and f"--sdpa_backend {flag}" in captured.err
    with pytest.raises(SystemExit) as exit_info:
        measure_sdpa_backends.main(["--visits", "0"])
    assert exit_info.value.code == 2
