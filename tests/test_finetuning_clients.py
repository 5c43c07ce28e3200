"""Fine-tuning and quantisation clients (PEFT, bitsandbytes): every MoE submodule is used through its own forward, so
whatever wraps it applies on every ``moe_implementation`` instead of being bypassed silently."""

import pytest
import torch

from modeling_spider import SpiderMoE
from tests.helpers import assert_lora_adapters_trained, float_tol, run_readme_recipe, tiny_model

peft = pytest.importorskip("peft")

IMPLEMENTATIONS = ("eager", "sorted", "grouped_mm")

#: LoRA target kinds (regular expressions peft matches against full module names) and the recurrent-layer modules
#: they must reach.
TARGETS = {
    "router": r".*\.layers\.\d+\.mlp\.router",
    "routed experts": r".*\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj",
    "shared experts": r".*\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj",
    "recurrent attention": r".*\.layers\.\d+\.self_attn\.(q_a|q_b|kv_a|kv_b|o)_proj(_with_mqa)?",
}


def logits_of(model, ids, router: bool = False):
    """The model's logits `(B, L, V)`, or with `router` its recurrent layers' router logits stacked: at init the
    experts' outputs are too small for a changed routing to show in the logits beyond roundoff."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_router_logits=router)
    return torch.stack(out.router_logits) if router else out.logits


def with_lora(model, pattern: str, seed: int):
    """`model` wrapped with a rank-4 LoRA on the modules matching `pattern`, its B matrices randomised (peft starts
    them at zero, which would make every adapter a no-op)."""
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=pattern))
    generator = torch.Generator().manual_seed(seed)
    touched = 0
    for name, param in wrapped.named_parameters():
        if ".lora_B.default." in name:  # peft's adapters, not Spider's own loop_lora.lora_B
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            touched += 1
    assert touched > 0, f"no LoRA module matched {pattern}"
    return wrapped


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_lora_on_each_target_changes_the_output(kind, implementation):
    model = tiny_model(seed=0, moe_implementation=implementation)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    before = logits_of(model, ids, router=kind == "router")
    wrapped = with_lora(model, TARGETS[kind], seed=2)
    after = logits_of(wrapped, ids, router=kind == "router")
    tol = float_tol(before, terms=4096)
    assert not torch.allclose(before, after, **tol), f"a LoRA on the {kind} left the {implementation} output unchanged"


@pytest.mark.parametrize("kind", ["routed experts", "router"])
def test_grouped_mm_honours_wrapped_experts_like_sorted(kind):
    """grouped_mm cannot multiply a wrapped expert's stacked weights; with a LoRA on the experts it falls back to the
    per-expert forward, so it gives what `sorted` gives."""
    outputs = {}
    for implementation in ("sorted", "grouped_mm"):
        model = tiny_model(seed=0, moe_implementation=implementation)
        ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
        outputs[implementation] = logits_of(with_lora(model, TARGETS[kind], seed=2), ids)
    reference = outputs["sorted"]
    torch.testing.assert_close(outputs["grouped_mm"], reference, **float_tol(reference, terms=4096))


def test_grouped_mm_blocker_names_the_wrapped_module():
    model = tiny_model(seed=0, moe_implementation="grouped_mm")
    moe = model.model.recurrent_block.layers[0].mlp
    assert isinstance(moe, SpiderMoE) and moe.grouped_mm_blocker() is None
    with_lora(model, TARGETS["routed experts"], seed=2)
    reason = moe.grouped_mm_blocker()
    assert reason is not None and reason.startswith("experts.0.gate_proj is a peft.")


def test_empty_expert_skips_frozen_weights():
    """An expert that gets no token returns `(0, D)` zeros; only trainable weights are tied into it (a frozen, for
    example quantised, weight may not support the reduction and needs no gradient)."""
    model = tiny_model(seed=0)
    expert = model.model.recurrent_block.layers[0].mlp.experts[0]
    for p in expert.parameters():
        p.requires_grad_(False)
    x = torch.zeros(0, model.config.hidden_size, requires_grad=True)
    out = SpiderMoE.run_expert(expert, x)
    assert out.shape == (0, model.config.hidden_size)
    expert.down_proj.weight.requires_grad_(True)
    out = SpiderMoE.run_expert(expert, x)
    out.sum().backward()
    assert expert.down_proj.weight.grad is not None and not expert.down_proj.weight.grad.any()


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
    quantised = bnb.nn.Linear8bitLt(reference_router.in_features, reference_router.out_features, bias=False,
                                    has_fp16_weights=False, threshold=0.0)
    quantised.load_state_dict(reference_router.state_dict())
    moe.router = quantised.to("cpu")  # bitsandbytes quantises on the move to a device
    assert moe.router.weight.dtype == torch.int8
    got = moe.route(x)
    bound = int8_matmul_bound(x, reference_router.weight.detach())
    excess = (got - expected).abs() - bound
    assert excess.max() <= 0, f"int8 router logits off by {excess.max():.3g} beyond the int8 bound"
    # the raw int8 codes (what F.linear on .weight read) are ~127/absmax times larger: far outside the bound
    assert (expected.abs().max() * 10 < (x @ moe.router.weight.float().T).abs().max())


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
    expert = model.model.recurrent_block.layers[0].mlp.experts[0]
    assert isinstance(expert.gate_proj, bnb.nn.Linear8bitLt) and expert.gate_proj.weight.dtype == torch.int8
    runs_forward_and_generate(model)


def test_bitsandbytes_4bit_load_generates_and_trains(saved_tiny):
    """4-bit on CPU: bitsandbytes' packed CPU inference kernel needs `out_features % 32 == 0`, which MLA's
    `kv_a_proj_with_mqa` (kv_lora_rank + qk_rope_head_dim outputs) does not meet at these sizes: it is skipped."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["kv_a_proj_with_mqa"])
    model = load(saved_tiny, quantization_config=config, device_map="cpu")
    assert all(type(m) is torch.nn.Linear for m in kept_modules(model).values())
    assert isinstance(model.model.recurrent_block.layers[0].mlp.experts[0].up_proj, bnb.nn.Linear4bit)
    runs_forward_and_generate(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=TARGETS["routed experts"]))
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
    expert_weight = model.model.recurrent_block.layers[0].mlp.experts[0].gate_proj.weight
    assert type(expert_weight) is not torch.nn.Parameter or type(expert_weight.data) is not torch.Tensor
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
