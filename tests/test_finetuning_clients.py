"""Fine-tuning and quantisation clients (PEFT, bitsandbytes, torchao): every MoE submodule is used through its own
forward, and the routed experts' fused parameters are read inside it, so whatever wraps a module or a parameter applies
on every ``experts_implementation`` instead of being bypassed silently.

PEFT reaches the fused experts (``...mlp.experts.gate_up_proj`` / ``down_proj``, 3-D) with
``LoraConfig(target_parameters=...)`` (its ``ParamWrapper`` parametrises the parameter while the module's forward
runs), as for transformers' own MoE models; ``target_modules`` reaches the router, the shared experts and attention.
Quantised loads (bitsandbytes, torchao) convert ``nn.Linear`` layers only: the fused experts stay unquantised (tested).
"""

import contextlib

import pytest
import torch

from modeling_spider import SpiderExperts
from tests.helpers import assert_lora_adapters_trained, float_tol, run_readme_recipe, tiny_model

peft = pytest.importorskip("peft")

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")

#: the routed experts' fused parameters, as LoraConfig(target_parameters=...) names them (suffixes of full names)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

#: LoRA target kinds: LoraConfig arguments (target_modules: regular expressions peft matches against full module
#: names) and the recurrent-layer modules or parameters they must reach.
TARGETS = {
    "router": dict(target_modules=r".*\.layers\.\d+\.mlp\.router"),
    "routed experts": dict(target_modules=[], target_parameters=EXPERT_PARAMETERS),
    "shared experts": dict(target_modules=r".*\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj"),
    "recurrent attention": dict(target_modules=r".*\.layers\.\d+\.self_attn\.(q_a|q_b|kv_a|kv_b|o)_proj(_with_mqa)?"),
}


def logits_of(model, ids, router: bool = False):
    """The model's logits `(B, L, V)`, or with `router` its recurrent layers' router logits stacked: at init the
    experts' outputs are too small for a changed routing to show in the logits beyond roundoff."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_router_logits=router)
    return torch.stack(out.router_logits) if router else out.logits


def with_lora(model, target: dict, seed: int):
    """`model` wrapped with a rank-4 LoRA on `target` (LoraConfig arguments), its B matrices randomised (peft starts
    them at zero, which would make every adapter a no-op)."""
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **target))
    generator = torch.Generator().manual_seed(seed)
    touched = 0
    for name, param in wrapped.named_parameters():
        if ".lora_B.default." in name:  # peft's adapters, not Spider's own loop_lora.lora_B
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            touched += 1
    assert touched > 0, f"no LoRA module matched {target}"
    return wrapped


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_lora_on_each_target_changes_the_output(kind, implementation):
    model = tiny_model(seed=0, experts_implementation=implementation)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    before = logits_of(model, ids, router=kind == "router")
    wrapped = with_lora(model, TARGETS[kind], seed=2)
    after = logits_of(wrapped, ids, router=kind == "router")
    tol = float_tol(before, terms=4096)
    assert not torch.allclose(before, after, **tol), f"a LoRA on the {kind} left the {implementation} output unchanged"


@pytest.mark.parametrize("kind", ["routed experts", "router"])
def test_lora_gives_the_same_output_on_every_implementation(kind):
    """The adapter applies inside every experts implementation alike (the LoRA'd weight is what each one reads)."""
    outputs = {}
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    for implementation in IMPLEMENTATIONS:
        model = tiny_model(seed=0, experts_implementation=implementation)
        outputs[implementation] = logits_of(with_lora(model, TARGETS[kind], seed=2), ids)
    reference = outputs["eager"]
    for implementation in ("grouped_mm", "batched_mm"):
        torch.testing.assert_close(
            outputs[implementation], reference, **float_tol(reference, terms=4096), msg=implementation
        )


def test_lora_on_the_fused_experts_trains_only_the_adapters():
    """target_parameters on the fused experts: per-expert low-rank adapters (peft's ParamWrapper, one per parameter),
    gradients reach them through grouped_mm, the base weights stay frozen and unchanged."""
    model = tiny_model(seed=0)
    wrapped = with_lora(model, TARGETS["routed experts"], seed=2)
    layers = model.model.recurrent_block.layers
    assert all(isinstance(layer.mlp.experts.get_base_layer(), SpiderExperts) for layer in layers)
    adapters = {n: p for n, p in wrapped.named_parameters() if ".lora_" in n and ".default." in n}
    assert len(adapters) == 2 * 2 * len(layers)  # A and B, for gate_up_proj and down_proj, per layer
    assert {n for n, p in wrapped.named_parameters() if p.requires_grad} == set(adapters)
    wrapped.train()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters.values())
    base = layers[0].mlp.experts.get_base_layer()
    assert base.gate_up_proj.grad is None and base.down_proj.grad is None


def test_lora_on_the_fused_experts_under_autocast_reads_the_adapted_weights_every_loop():
    """Under bf16 autocast the experts' weights are cast once per forward for all loops (`shared_weight_casts`); with
    LoRA on them the weight each loop reads is computed (base + adapter), so it is cast afresh each call: the loss is
    the one a cast per call gives, to the bit, and the adapters get gradients."""
    from spider_training.mixed_precision import autocast_experts, shared_weight_casts

    wrapped = with_lora(tiny_model(seed=0, n_loops=3), TARGETS["routed experts"], seed=2).train()
    adapters = [p for n, p in wrapped.named_parameters() if ".lora_" in n and ".default." in n]
    with torch.no_grad():
        for p in adapters:  # B starts at zero: give the adapters a delta, so a stale cast would show
            p.normal_(std=0.05, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    losses = []
    assert autocast_experts(wrapped) == wrapped.config.num_recurrent_layers
    for shared in (True, False):
        wrapped.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            shared_weight_casts() if shared else contextlib.nullcontext(),
        ):
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters)
    assert torch.equal(losses[0], losses[1])


def int8_matmul_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Worst-case error `(T, E)` of LLM.int8's `x @ weight.T` against fp32: both operands are quantised with a
    row-wise absmax scale `s` to 127 levels, so each element moves by at most `s / 254`; the product's error is
    bounded by `sum_j |x_j| dw + |w_j| dx + dx dw`, plus fp32 roundoff of the same sum."""
    dx = x.abs().amax(dim=1, keepdim=True) / 254  # (T, 1)
    dw = weight.abs().amax(dim=1, keepdim=True) / 254  # (E, 1)
    D = x.shape[1]
    bound = x.abs().sum(1, keepdim=True) * dw.T + dx * weight.abs().sum(1)[None] + D * dx * dw.T
    return bound + float_tol(x @ weight.T, terms=D)["atol"]


def test_bitsandbytes_int8_router_matches_fp32_within_int8_error():
    bnb = pytest.importorskip("bitsandbytes")
    model = tiny_model(seed=0)
    moe = model.model.recurrent_block.layers[0].mlp
    reference_router = moe.router
    x = torch.randn(32, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    expected = moe.route(x)
    quantised = bnb.nn.Linear8bitLt(
        reference_router.in_features, reference_router.out_features, bias=False, has_fp16_weights=False, threshold=0.0
    )
    quantised.load_state_dict(reference_router.state_dict())
    moe.router = quantised.to("cpu")  # bitsandbytes quantises on the move to a device
    assert moe.router.weight.dtype == torch.int8
    got = moe.route(x)
    bound = int8_matmul_bound(x, reference_router.weight.detach())
    excess = (got - expected).abs() - bound
    assert excess.max() <= 0, f"int8 router logits off by {excess.max():.3g} beyond the int8 bound"
    # the raw int8 codes (what F.linear on .weight read) are ~127/absmax times larger: far outside the bound
    assert expected.abs().max() * 10 < (x @ moe.router.weight.float().T).abs().max()


KEPT_FP32 = ("router", "boundary_predictor.dense", "boundary_predictor.out_proj", "halt_predictor", "lm_head")


def kept_modules(model):
    return {name: module for name, module in model.named_modules() if name.endswith(KEPT_FP32)}


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A saved tiny model whose every quantisable layer has `in_features % 64 == 0` (bitsandbytes' 4-bit block)."""
    folder = tmp_path_factory.mktemp("quant") / "tiny"
    tiny_model(seed=0, q_lora_rank=64, kv_lora_rank=64, moe_intermediate_size=64).save_pretrained(folder)
    return folder


def load(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


def assert_fused_experts_unquantised(model):
    """bitsandbytes and torchao quantise nn.Linear layers: the fused 3-D experts load as plain fp32 parameters (their
    release dtype) and run through the experts implementation in high precision."""
    for layer in model.model.recurrent_block.layers:
        for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert type(param) is torch.nn.Parameter and type(param.data) is torch.Tensor
            assert param.dtype == torch.float32 and param.dim() == 3


def runs_forward_and_generate(model):
    ids = torch.tensor([[257] + list(b"Four score and seven")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=256)
    assert torch.isfinite(logits).all() and logits.dtype == torch.float32
    assert out.shape == (1, ids.shape[1] + 8) and torch.equal(out[:, : ids.shape[1]], ids)


def test_bf16_load_keeps_the_decision_modules_in_fp32(saved_tiny):
    model = load(saved_tiny, dtype=torch.bfloat16)
    kept = kept_modules(model)
    assert len(kept) == 4 * 1 + model.config.num_recurrent_layers  # boundary x2, halt, lm_head, one router per layer
    assert all(m.weight.dtype == torch.float32 for m in kept.values())
    assert model.model.prelude_layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
    runs_forward_and_generate(model)


def test_bitsandbytes_8bit_load_quantises_all_but_the_kept_modules(saved_tiny):
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    model = load(saved_tiny, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu")
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in kept_modules(model).values())
    shared = model.model.recurrent_block.layers[0].mlp.shared_experts
    assert isinstance(shared.gate_proj, bnb.nn.Linear8bitLt) and shared.gate_proj.weight.dtype == torch.int8
    assert_fused_experts_unquantised(model)
    runs_forward_and_generate(model)


def test_bitsandbytes_4bit_load_generates_and_trains(saved_tiny):
    """4-bit on CPU: bitsandbytes' packed CPU inference kernel needs `out_features % 32 == 0`, which MLA's
    `kv_a_proj_with_mqa` (kv_lora_rank + qk_rope_head_dim outputs) does not meet at these sizes: it is skipped."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["kv_a_proj_with_mqa"])
    model = load(saved_tiny, quantization_config=config, device_map="cpu")
    assert all(type(m) is torch.nn.Linear for m in kept_modules(model).values())
    assert isinstance(model.model.recurrent_block.layers[0].mlp.shared_experts.up_proj, bnb.nn.Linear4bit)
    assert_fused_experts_unquantised(model)
    runs_forward_and_generate(model)
    # QLoRA: adapters on the 4-bit shared experts and on the (unquantised, frozen) fused experts
    wrapped = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, target_modules=r".*\.shared_experts\.(gate|up|down)_proj", target_parameters=EXPERT_PARAMETERS
        ),
    )
    wrapped.train()
    ids = torch.tensor([[257] + list(b"Four score and seven years ago")])
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for n, p in wrapped.named_parameters() if "lora_" in n and ".default." in n]
    assert torch.isfinite(loss) and grads and all(g is not None for g in grads)


def test_torchao_int8_weight_only_load_generates(saved_tiny):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    model = load(saved_tiny, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), device_map="cpu")
    shared_weight = model.model.recurrent_block.layers[0].mlp.shared_experts.gate_proj.weight
    assert type(shared_weight) is not torch.nn.Parameter or type(shared_weight.data) is not torch.Tensor
    assert_fused_experts_unquantised(model)
    for name, module in kept_modules(model).items():
        assert type(module.weight.data) is torch.Tensor and module.weight.dtype == torch.float32, name
    runs_forward_and_generate(model)


def test_readme_peft_trainer_recipe_runs_as_written(tmp_path):
    """The README's "Fine-tuning a release" block, verbatim except for the release folder (a tiny one here), in a
    fresh process that loads the release through trust_remote_code."""
    from tokenization_spider import SpiderTokenizer

    release = tmp_path / "release"
    tiny_model(seed=0).save_pretrained(release)
    SpiderTokenizer().save_pretrained(release)
    run_readme_recipe("peft-trainer", release, tmp_path)
    assert_lora_adapters_trained(tmp_path / "runs/spider-lora/adapter/adapter_model.safetensors")
