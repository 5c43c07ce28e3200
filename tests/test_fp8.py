"""Tests of spider_training.fp8: torchao Float8Linear conversion of Spider (seed tk-train.py configure_fp8_training),
precision resolution (seed detect_precision_mode) and checkpoints of FP8-trained models. CPU: emulate mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from modeling_spider import SpiderForConditionalGeneration  # noqa: E402
from spider_training import fp8  # noqa: E402
from spider_training.fp8 import (  # noqa: E402
    ao_recipe_kwargs,
    convert_fp8_to_plain,
    convert_model_to_fp8,
    fp8_module_filter,
    fp8_to_plain_state_dict,
    resolve_precision,
)
from tests.helpers import tiny_model, train_step  # noqa: E402

# tk-train.py's skip list, restated here (its configure_fp8_training.module_filter_fn).
TK_TRAIN_SKIP_WORDS = ["boundary_predictor", "loop_embedding", "engram", "layernorm", "norm", "embed_tokens",
                       "lm_head", "halt_predictor", "router"]



def pin_boundaries(model, logit: float = 4.0):
    """Make every byte close a segment with probability sigmoid(`logit`), whatever the prelude computes."""
    with torch.no_grad():
        model.model.flexitokens.boundary_predictor.out_proj.weight.zero_()
        model.model.flexitokens.boundary_predictor.out_proj.bias.fill_(logit)
    return model


def loss_and_grads(model, input_ids, seed=1):
    out, grads = train_step(model, input_ids, seed)
    return out.loss.detach(), grads


@pytest.fixture(scope="module")
def input_ids():
    torch.manual_seed(7)
    return torch.randint(0, 256, (2, 40))


# ----------------------------------------------------------------------------------------------------------------------
# Which modules
# ----------------------------------------------------------------------------------------------------------------------


def test_filter_rules():
    assert fp8_module_filter(nn.Linear(32, 48), "model.recurrent_block.layers.0.mlp.shared_experts.up_proj")
    assert not fp8_module_filter(nn.Linear(32, 48), "model.recurrent_block.layers.0.post_attention_layernorm.proj")
    assert not fp8_module_filter(nn.Linear(32, 48), "model.recurrent_block.layers.0.mlp.router")
    assert not fp8_module_filter(nn.Linear(30, 48), "model.recurrent_block.layers.0.mlp.shared_experts.up_proj")
    assert not fp8_module_filter(nn.Linear(32, 40), "model.recurrent_block.layers.0.mlp.shared_experts.up_proj")
    assert not fp8_module_filter(nn.Conv1d(32, 32, 3), "model.recurrent_block.layers.0.conv")
    already = Float8Linear.from_float(nn.Linear(32, 32), config=fp8.build_float8_config("tensorwise", emulate=True))
    assert not fp8_module_filter(already, "model.recurrent_block.layers.0.self_attn.o_proj")


def test_converts_exactly_the_intended_modules():
    model = tiny_model()
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = {
        fqn for fqn, m in linears.items()
        if not any(word in fqn for word in TK_TRAIN_SKIP_WORDS) and m.in_features % 16 == 0 and m.out_features % 16 == 0
    }
    report = convert_model_to_fp8(model, recipe="tensorwise", emulate=True, layers="tk_train")
    converted = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    skipped_words = {}  # first tk-train.py skip word in each skipped layer's name (the tiny preset's dims all divide by 16)
    for fqn in set(linears) - expected:
        word = next(w for w in TK_TRAIN_SKIP_WORDS if w in fqn)
        skipped_words[word] = skipped_words.get(word, 0) + 1
    assert converted == expected == set(report.converted_fqns)
    assert report.converted == len(expected) and report.linear_total == len(linears)
    assert not report.already_converted and report.recipe == "tensorwise" and report.emulate is True
    assert report.message == (
        f"FP8: converted {len(expected)} of {len(linears)} linear layers (recipe=tensorwise, emulate=True, "
        f"layers=tk_train); left in high precision: " + ", ".join(
            f"{n} name contains {w!r}" for w, n in sorted(skipped_words.items(), key=lambda kv: f"name contains {kv[0]!r}"))
    )
    assert set(report.skipped) == set(linears) - expected

    cfg = model.config
    for layer in range(cfg.num_recurrent_layers):
        prefix = f"model.recurrent_block.layers.{layer}"
        # the routed experts are fused 3-D parameters, not nn.Linear: Float8Linear does not reach them
        assert not any(fqn.startswith(f"{prefix}.mlp.experts") for fqn in converted)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"{prefix}.mlp.shared_experts.{proj}" in converted
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):  # attention
            assert f"{prefix}.self_attn.{proj}" in converted
        assert f"{prefix}.mlp.router" not in converted
    for dense in ("model.prelude_layers.0", "model.coda_layers.0"):  # dense MLPs and their attention
        for proj in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj"):
            assert f"{dense}.{proj}" in converted
    for kept in ("lm_head", "model.flexitokens.boundary_predictor.dense", "model.flexitokens.boundary_predictor.out_proj",
                 "model.recurrent_block.halt_predictor",
                 "model.recurrent_block.layers.1.engram.key_proj", "model.recurrent_block.layers.1.engram.value_proj"):
        assert kept in linears and kept not in converted
    # 64x64, 16-divisible: skipped by name alone
    assert report.skipped["model.flexitokens.boundary_predictor.dense"] == "name contains 'boundary_predictor'"
    assert report.skipped["model.recurrent_block.layers.1.engram.key_proj"] == "name contains 'engram'"


def test_deprecated_layers_name_seed_still_converts_the_tk_train_layers(caplog):
    """``--fp8_layers seed`` (the old name of ``tk_train``) converts the same layers, reports ``tk_train`` and warns
    once per process that it is deprecated."""
    from spider_training import fp8 as fp8_module

    fp8_module._warned_layer_aliases.discard("seed")
    new = convert_model_to_fp8(tiny_model(), emulate=True, layers="tk_train")
    with caplog.at_level("WARNING", logger="spider_training.fp8"):
        old = convert_model_to_fp8(tiny_model(), emulate=True, layers="seed")
        convert_model_to_fp8(tiny_model(), emulate=True, layers="seed")
    assert old.converted == new.converted and old.skipped == new.skipped and old.layers == "tk_train"
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warnings == ["--fp8_layers seed is deprecated; use --fp8_layers tk_train (the same layers)"]


def test_emulate_default_follows_cuda_availability():
    model = tiny_model()
    report = convert_model_to_fp8(model, layers="tk_train")
    assert report.emulate is (not torch.cuda.is_available())
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert layers and all(m.config.emulate is report.emulate and m.config.pad_inner_dim for m in layers)
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        convert_model_to_fp8(tiny_model(), recipe="axiswise", layers="tk_train")


# ----------------------------------------------------------------------------------------------------------------------
# Training step on CPU, every recipe
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_recipes_train_on_cpu_close_to_high_precision(recipe, input_ids):
    # Boundaries pinned far from the threshold (every byte closes a segment, p = 0.98): with hard boundaries, FP8
    # noise on a freshly initialised predictor (p near 0.5) would flip decisions and compare different segmentations.
    reference = pin_boundaries(tiny_model())
    ref_loss, ref_grads = loss_and_grads(reference, input_ids)
    model = pin_boundaries(tiny_model())
    report = convert_model_to_fp8(model, recipe=recipe, emulate=True, layers="tk_train")
    assert report.recipe == recipe and report.converted > 0
    loss, grads = loss_and_grads(model, input_ids)
    assert torch.isfinite(loss)
    # FP8 rounding (e4m3: 3 mantissa bits) moves the loss only slightly on a freshly initialised model (measured:
    # relative change ~2e-4 for all three recipes)
    assert abs(loss.item() - ref_loss.item()) < 0.005 * ref_loss.item()
    assert loss.item() != ref_loss.item()  # the FP8 path was really taken
    # Gradients point the same way (e4m3 keeps ~2 significant digits per element; cosine of the whole gradient
    # stays near 1 when the segmentation is the same).
    for name, min_cosine in (("model.recurrent_block.layers.0.mlp.shared_experts.gate_proj.weight", 0.95),
                             ("model.prelude_layers.0.self_attn.o_proj.weight", 0.95), ("lm_head.weight", 0.95)):
        g, r = grads[name].flatten(), ref_grads[name].flatten()
        assert torch.isfinite(g).all()
        assert torch.nn.functional.cosine_similarity(g, r, dim=0) > min_cosine, name


def test_double_conversion_is_a_noop(input_ids):
    model = tiny_model()
    first = convert_model_to_fp8(model, recipe="rowwise", emulate=True, layers="tk_train")
    modules_before = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    second = convert_model_to_fp8(model, recipe="tensorwise", emulate=True, layers="tk_train")
    modules_after = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert second.already_converted and second.converted == first.converted
    assert second.recipe == "rowwise"  # recovered from the existing layers' config
    assert modules_before.keys() == modules_after.keys()
    assert all(modules_before[k] is modules_after[k] for k in modules_before)
    assert "already converted" in second.message
    loss, _ = loss_and_grads(model, input_ids)
    assert torch.isfinite(loss)


def test_accelerate_ao_path_and_ours_do_not_convert_twice():
    from accelerate.utils.ao import convert_model_to_fp8_ao  # what Accelerator.prepare calls for fp8 / AO

    # accelerate first (its default filter and config), then ours: ours detects it and leaves it alone
    model = tiny_model()
    convert_model_to_fp8_ao(model, config=Float8LinearConfig(emulate=True, pad_inner_dim=True))
    converted = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    report = convert_model_to_fp8(model, emulate=True, layers="tk_train")
    assert report.already_converted and set(report.converted_fqns) == set(converted)
    assert all(m is converted[fqn] for fqn, m in model.named_modules() if isinstance(m, Float8Linear))

    # ours first, then accelerate's pass with ao_recipe_kwargs: the filter rejects Float8Linear, nothing changes
    model = tiny_model()
    ours = convert_model_to_fp8(model, emulate=True, layers="tk_train")
    before = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    kwargs = ao_recipe_kwargs("tensorwise", emulate=True)
    assert kwargs.config.emulate is True and kwargs.config.pad_inner_dim is True
    assert kwargs.config.enable_fsdp_float8_all_gather is False
    convert_model_to_fp8_ao(model, config=kwargs.config, module_filter_func=kwargs.module_filter_func)
    after = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert before.keys() == after.keys() == set(ours.converted_fqns)
    assert all(before[k] is after[k] for k in before)


# ----------------------------------------------------------------------------------------------------------------------
# Fused experts
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_fused_experts_stay_high_precision_on_their_implementation(implementation, input_ids):
    """Float8Linear converts nn.Linear layers only: the fused experts keep plain parameters and the model's
    experts_implementation (no switch is needed any more: with per-expert Linears, converting them forced
    grouped_mm to "sorted"), and a training step gives them gradients."""
    model = tiny_model(experts_implementation=implementation)
    report = convert_model_to_fp8(model, emulate=True, layers="tk_train")
    assert report.converted > 0 and model.config._experts_implementation == implementation
    for layer in model.model.recurrent_block.layers:
        experts = layer.mlp.experts
        assert type(experts.gate_up_proj) is nn.Parameter and type(experts.down_proj) is nn.Parameter
        assert not any(isinstance(m, Float8Linear) for m in experts.modules())
    _, grads = loss_and_grads(model, input_ids)
    gate_up = grads["model.recurrent_block.layers.0.mlp.experts.gate_up_proj"]
    assert torch.isfinite(gate_up).all() and gate_up.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------------


def test_converted_checkpoint_loads_into_plain_model(tmp_path, input_ids):
    plain_reference = tiny_model()
    model = tiny_model()
    convert_model_to_fp8(model, emulate=True, layers="tk_train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_and_grads(model, input_ids)
    optimizer.step()  # weights now differ from the initialisation

    state = model.state_dict()
    plain_state = plain_reference.state_dict()
    assert state.keys() == plain_state.keys()
    assert all(type(t) is torch.Tensor and t.dtype == plain_state[k].dtype for k, t in state.items())

    model.save_pretrained(tmp_path)
    loaded = SpiderForConditionalGeneration.from_pretrained(tmp_path)
    assert not any(isinstance(m, Float8Linear) for m in loaded.modules())
    loaded_state = loaded.state_dict()
    assert loaded_state.keys() == state.keys()
    assert all(torch.equal(loaded_state[k], state[k]) for k in state)

    # swapping the converted model back to nn.Linear gives the same function as the loaded plain model
    n_float8 = sum(isinstance(m, Float8Linear) for m in model.modules())
    assert convert_fp8_to_plain(model) == n_float8 > 0
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, loaded(input_ids).logits, rtol=0, atol=0)


def test_fsdp_float8_all_gather_weights_save_through_plain_state_dict(tmp_path):
    from accelerate.utils.ao import convert_model_to_fp8_ao

    model = tiny_model()
    # accelerate's default AORecipeKwargs config turns on FSDP float8 all-gather: weights become wrapper subclasses
    config = Float8LinearConfig(emulate=True, pad_inner_dim=True, enable_fsdp_float8_all_gather=True)
    convert_model_to_fp8_ao(model, config=config)
    assert any(type(t) is not torch.Tensor for t in model.state_dict().values())
    plain = fp8_to_plain_state_dict(model)
    assert all(type(t) in (torch.Tensor, nn.Parameter) for t in plain.values())
    model.save_pretrained(tmp_path, state_dict=dict(plain))  # save_pretrained empties the dict it is given
    loaded = SpiderForConditionalGeneration.from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == plain.keys()
    assert all(torch.equal(loaded[k], plain[k]) for k in plain)
    swapped = convert_fp8_to_plain(model)
    assert swapped > 0 and all(type(p) is nn.Parameter for p in model.parameters())


# ----------------------------------------------------------------------------------------------------------------------
# --precision
# ----------------------------------------------------------------------------------------------------------------------


def _fake_cuda(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)


#: A made-up measurement in which FP8 wins: what `auto` needs before it picks FP8 (none of the real ones does yet).
FP8_WINS = {"gpu": "test double", "batch": "-", "bf16_seconds": 1.0, "fp8_seconds": 0.5, "fp8": "-", "versions": "-"}


@pytest.mark.parametrize(
    "capability, torchao_ok, measured, preset, expected",
    [
        (None, True, {}, "small", "fp32"),                          # CPU
        ((9, 0), True, None, "1b", "bf16"),                         # H100/H200, the real table: FP8 measured slower
        ((9, 0), True, None, "small", "bf16"),                      # no measurement for the preset: bf16
        ((10, 0), True, None, "1b", "bf16"),                        # B200: nothing measured there yet
        ((9, 0), True, {((9, 0), "1b"): FP8_WINS}, "1b", "fp8"),    # FP8 measured faster for this class and preset
        ((9, 0), True, {((9, 0), "1b"): FP8_WINS}, "small", "bf16"),  # ... but not for another preset
        ((9, 0), True, {((9, 0), "1b"): FP8_WINS}, None, "bf16"),   # a custom config has no measurement
        ((10, 0), True, {((9, 0), "1b"): FP8_WINS}, "1b", "bf16"),  # ... nor another GPU class
        ((8, 0), True, {((8, 0), "1b"): FP8_WINS}, "1b", "bf16"),   # A100: no FP8 matmuls, whatever the table says
        ((9, 0), False, {((9, 0), "1b"): FP8_WINS}, "1b", "bf16"),  # no torchao
    ],
)
def test_resolve_precision_auto_follows_the_measurements(monkeypatch, capability, torchao_ok, measured, preset,
                                                          expected):
    _fake_cuda(monkeypatch, capability)
    monkeypatch.setattr(fp8, "torchao_fp8_available", lambda: torchao_ok)
    if measured is not None:
        monkeypatch.setattr(fp8, "FP8_MEASURED", measured)
    assert resolve_precision("auto", preset) == expected


def test_the_recorded_h200_measurement_keeps_bf16():
    entry = fp8.FP8_MEASURED[((9, 0), "1b")]
    assert entry["fp8_seconds"] > entry["bf16_seconds"]
    assert not fp8.fp8_measured_faster("1b", (9, 0)) and not fp8.fp8_measured_faster("1b", (10, 0))


# ----------------------------------------------------------------------------------------------------------------------
# --fp8_layers auto: torchao's own filter
# ----------------------------------------------------------------------------------------------------------------------


def test_auto_layers_follow_torchaos_filter_on_the_1b_preset():
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    from configuration_spider import SpiderConfig

    with torch.device("meta"):  # the 1b shapes without the memory
        model = SpiderForConditionalGeneration(SpiderConfig.from_preset("1b"))
    for recipe in ("tensorwise", "rowwise"):
        torchao_filter = _auto_filter_for_recipe(recipe, filter_fqns=TK_TRAIN_SKIP_WORDS)
        chosen = fp8.fp8_layer_filter("auto", recipe)
        converted = {fqn for fqn, m in model.named_modules() if chosen(m, fqn)}
        expected = {fqn for fqn, m in model.named_modules() if torchao_filter(m, fqn)}
        assert converted == expected and converted, recipe
    # tensorwise, by hand: a 2048 -> 512 shared-expert projection is below the size where FP8 pays (K <= 4096 and N <= 1024);
    # the 2048 -> 11008 dense SwiGLU projection is above it
    gate = model.model.recurrent_block.layers[0].mlp.shared_experts.gate_proj
    reason = fp8.fp8_skip_reason(gate, "model.recurrent_block.layers.0.mlp.shared_experts.gate_proj", "auto")
    assert reason is not None and reason.startswith(fp8.AUTO_SKIP_SIZE) and "in_features=2048" in reason
    assert fp8.fp8_skip_reason(model.model.prelude_layers[0].mlp.up_proj, "model.prelude_layers.0.mlp.up_proj",
                               "auto") is None


def test_auto_layers_convert_nothing_on_the_tiny_preset_and_say_why():
    model = tiny_model()
    report = convert_model_to_fp8(model, emulate=True)  # layers="auto" is the default
    assert report.layers == "auto" and report.converted == 0
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    kinds = report.skipped_by_reason()
    assert kinds[fp8.AUTO_SKIP_SIZE] > 0 and sum(kinds.values()) == report.linear_total
    assert f"{kinds[fp8.AUTO_SKIP_SIZE]} {fp8.AUTO_SKIP_SIZE}" in report.message
    with pytest.raises(ValueError, match="--fp8_layers must be one of"):
        convert_model_to_fp8(tiny_model(), layers="most")


def test_resolve_precision_explicit_and_invalid(monkeypatch):
    _fake_cuda(monkeypatch, None)
    assert resolve_precision("fp8") == "fp8"
    assert resolve_precision(" BF16 ") == "bf16"
    assert resolve_precision("fp32") == "fp32"
    with pytest.raises(ValueError, match=r"--precision must be one of \('auto', 'fp8', 'bf16', 'fp32'\), got 'fp16'"):
        resolve_precision("fp16")
    with pytest.raises(ValueError):
        resolve_precision(None)
    monkeypatch.setattr(fp8, "torchao_fp8_available", lambda: False)
    with pytest.raises(ImportError, match="torchao"):
        resolve_precision("fp8")


@pytest.mark.slow
def test_tensorwise_fp8_trains_under_compile_as_eagerly(input_ids):
    """FP8 judged under compile (issues 51, 64): the emulated tensorwise model compiled as ``--compile`` compiles it
    (one graph per layer kind, traced through torchao's float8 tensors; ``aot_eager``: AOTAutograd's joint graph and
    partition of each layer, run without generating code, about 25 s here; inductor takes about 100 s to compile the
    three graphs) trains the same loss curve as eager FP8, within one bf16 rounding per loss (the tolerance the issue
    sets)."""
    from spider_training.compile import compile_model

    curves = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = pin_boundaries(tiny_model())
        assert convert_model_to_fp8(model, recipe="tensorwise", emulate=True, layers="tk_train").converted > 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runner = compile_model(model, backend="aot_eager") if compiled else model
        losses = []
        for step in range(2):
            torch.manual_seed(step)  # the boundary predictor samples
            loss = runner(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert any(isinstance(m, Float8Linear) for m in model.modules())
        curves.append(torch.tensor(losses))
    eager, compiled = curves
    assert eager[0] != eager[-1]  # the weights moved: two different models were compared
    torch.testing.assert_close(compiled, eager, rtol=torch.finfo(torch.bfloat16).eps, atol=0)
