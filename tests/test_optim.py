"""spider_training.optim: Muon for the hidden matrices and AdamW for the rest, as one optimizer for Trainer."""

import copy
import dataclasses
import math

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from spider_training import optim
from spider_training.arguments import DEFAULT_MUON_LR, parse_args
from spider_training.optim import Muon, MuonWithAdamW, is_hidden_matrix, muon_with_adamw
from tests.helpers import tiny_model, train_step


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


def _step(model, optimizer, seed: int) -> None:
    _, grads = train_step(model, _ids(seed), seed=seed)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_the_split_follows_the_layer_stacks():
    model = tiny_model(seed=0)
    muon = {n for n, p in model.named_parameters() if is_hidden_matrix(n, p)}
    assert "model.prelude_layers.0.self_attn.q_a_proj.weight" in muon
    assert {
        "model.recurrent_block.layers.0.mlp.experts.gate_up_proj",
        "model.recurrent_block.layers.0.mlp.experts.down_proj",
    } <= muon
    assert "model.flexitokens.boundary_predictor.dense.weight" in muon
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.recurrent_block.layers.0.mlp.router.weight",
        "model.recurrent_block.loop_lora.lora_B",
        "model.norm.weight",
    ):
        assert name not in muon, name
    assert all(dict(model.named_parameters())[n].dim() == (3 if ".mlp.experts." in n else 2) for n in muon)


def test_one_optimizer_steps_as_muon_and_adamw_side_by_side():
    """MuonWithAdamW only presents its two optimizers as one: its updates equal them stepped separately
    (the same operations on the same tensors, so bit for bit)."""
    model = tiny_model(seed=0)
    twin = copy.deepcopy(model)
    combined = muon_with_adamw(model, muon_lr=0.02, lr=1e-3, weight_decay=0.1, muon_experts=True)
    named = dict(twin.named_parameters())
    hidden = [p for n, p in named.items() if is_hidden_matrix(n, p)]
    rest = [p for n, p in named.items() if not is_hidden_matrix(n, p)]
    gate_up = [p for n, p in named.items() if n.endswith("mlp.experts.gate_up_proj")]
    assert gate_up
    separate = [
        Muon(
            [
                {"params": [p for p in hidden if all(p is not q for q in gate_up)]},
                {"params": gate_up, "row_blocks": 2},
            ],
            lr=0.02,
            weight_decay=0.1 * 1e-3 / 0.02,
        ),
        torch.optim.AdamW(
            [
                {"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=1e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
        ),
    ]
    for seed in range(3):
        _step(model, combined, seed)
        train_step(twin, _ids(seed), seed=seed)
        for opt in separate:
            opt.step()
            opt.zero_grad(set_to_none=True)
    changed = 0
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
        changed += not torch.equal(p, dict(tiny_model(seed=0).named_parameters())[name])
    assert changed > 0


BF16_UNIT_ROUNDOFF = 2.0**-8


@pytest.mark.parametrize("shape", [(96, 160), (160, 96), (128, 128)])
def test_muon_steps_as_torchs_muon(shape):
    """spider_training.optim.Muon is torch.optim.Muon with the Newton-Schulz products computed in fp32 on
    bf16-rounded values where bf16 products are not native (this CPU): one step from the same parameter, gradient and
    momentum agrees with torch's. Both round every product to bf16 and differ only in summation order, so the
    orthogonalised update may differ by about one bf16 rounding per Newton-Schulz step: at most ns_steps * 2^-8 of
    its norm (relative Frobenius)."""
    gen = torch.Generator().manual_seed(sum(shape))
    start, grads = torch.randn(shape, generator=gen), [torch.randn(shape, generator=gen) for _ in range(2)]
    lr, weight_decay = 0.02, 0.1
    stepped = []
    for cls in (Muon, torch.optim.Muon):
        param = torch.nn.Parameter(start.clone())
        opt = cls([param], lr=lr, weight_decay=weight_decay)
        for grad in grads:  # the second step also uses the momentum buffer
            before = param.detach().clone()
            param.grad = grad.clone()
            opt.step()
        stepped.append((param.detach(), before, opt.state_dict()))
    (ours, before, state), (theirs, before_torch, torch_state) = stepped
    adjusted_lr = lr * math.sqrt(max(1, shape[0] / shape[1]))
    update = (before_torch * (1 - lr * weight_decay) - theirs) / adjusted_lr  # torch's orthogonalised update
    assert update.norm() > 0.5 * math.sqrt(min(shape))  # about orthogonal: singular values near 1
    ns_steps = torch.optim.Muon([torch.nn.Parameter(start)]).param_groups[0]["ns_steps"]
    tolerance = ns_steps * BF16_UNIT_ROUNDOFF
    assert (ours - theirs).norm() <= tolerance * adjusted_lr * update.norm() + (before - before_torch).norm() * 2
    # the same state dict layout: a checkpoint moves between the two
    assert state["param_groups"] == torch_state["param_groups"]
    assert state["state"][0].keys() == torch_state["state"][0].keys() == {"momentum_buffer"}


def test_muon_moves_each_fused_expert_as_its_per_expert_weights():
    """The fused experts under Muon: expert e's gate, up and down projections take the step each would take as its own
    2-D parameter (the per-expert layout of older releases), over two steps (momentum included). The same operations on
    the same values, so exactly equal."""
    E, I, D = 3, 16, 24
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * I, D, generator=gen), torch.randn(E, D, I, generator=gen)
    grads = [(torch.randn(E, 2 * I, D, generator=gen), torch.randn(E, D, I, generator=gen)) for _ in range(2)]
    fused = [torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())]
    per_expert = [torch.nn.Parameter(t.clone()) for e in range(E) for t in (gate_up[e, :I], gate_up[e, I:], down[e])]
    opt_fused = Muon([{"params": [fused[0]], "row_blocks": 2}, {"params": [fused[1]]}], lr=0.02, weight_decay=0.1)
    opt_per_expert = Muon(per_expert, lr=0.02, weight_decay=0.1)
    for grad_gate_up, grad_down in grads:
        fused[0].grad, fused[1].grad = grad_gate_up.clone(), grad_down.clone()
        for e in range(E):
            for j, g in enumerate((grad_gate_up[e, :I], grad_gate_up[e, I:], grad_down[e])):
                per_expert[3 * e + j].grad = g.clone()
        opt_fused.step()
        opt_per_expert.step()
    for e in range(E):
        assert torch.equal(fused[0][e, :I], per_expert[3 * e]), e
        assert torch.equal(fused[0][e, I:], per_expert[3 * e + 1]), e
        assert torch.equal(fused[1][e], per_expert[3 * e + 2]), e
    with pytest.raises(ValueError, match="row_blocks=3"):
        Muon([{"params": [torch.nn.Parameter(gate_up.clone())], "row_blocks": 3}], lr=0.02)  # 32 rows


def test_newton_schulz_products_stay_off_slow_bf16_kernels(monkeypatch):
    """Where bf16 products are not native, no matrix product of the iteration runs in bf16 (on an AVX2 CPU one is
    ~20x slower than fp32); where they are (CUDA, AVX512-BF16/AMX CPUs) every one does, as in torch's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ProductDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.dtypes.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    grad = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    outputs = {}
    for native in (False, True):
        monkeypatch.setattr(optim, "_bf16_matmul_is_native", lambda device: native)
        with ProductDtypes() as seen:
            outputs[native] = optim.zeropower_via_newtonschulz(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert len(seen.dtypes) == 15  # 3 products per step
        assert set(seen.dtypes) == {torch.bfloat16 if native else torch.float32}
        assert outputs[native].dtype == torch.bfloat16
    diff = (outputs[True].float() - outputs[False].float()).norm() / outputs[True].float().norm()
    assert diff <= 5 * BF16_UNIT_ROUNDOFF
    with pytest.raises(ValueError, match=r"2-D matrices, got a gradient of shape \(3, 4, 5\)"):
        optim.zeropower_via_newtonschulz(torch.ones(3, 4, 5), (3.4445, -4.7750, 2.0315), 5, 1e-7)


def test_a_scheduler_drives_both_halves_and_state_round_trips():
    """A Trainer-style LambdaLR scales both halves' peak rates; a state dict written mid-run and loaded into a fresh
    optimizer continues exactly as the run that never stopped (Trainer's resume)."""
    ref = tiny_model(seed=0)
    opt = muon_with_adamw(ref, muon_lr=0.02, lr=1e-3, weight_decay=0.1)
    sched = LambdaLR(opt, lambda step: 0.5**step)
    _step(ref, opt, 0)
    sched.step()
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.01)
    assert [g["lr"] for g in opt.adamw.param_groups] == pytest.approx([5e-4, 5e-4])
    saved_model, saved_opt, saved_sched = (
        copy.deepcopy(ref.state_dict()),
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(sched.state_dict()),
    )
    assert set(saved_opt) == {"muon", "adamw"} and saved_opt["muon"]["state"]
    for seed in (1, 2):
        _step(ref, opt, seed)
        sched.step()

    resumed = tiny_model(seed=5)
    resumed.load_state_dict(saved_model)
    opt2 = muon_with_adamw(resumed, muon_lr=0.02, lr=1e-3, weight_decay=0.1)
    sched2 = LambdaLR(opt2, lambda step: 0.5**step)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert opt2.param_groups[-1] is opt2.muon.param_groups[0]  # re-linked after the children made new groups
    assert opt2.param_groups[0] is opt2.adamw.param_groups[0]
    for seed in (1, 2):
        _step(resumed, opt2, seed)
        sched2.step()
    assert opt2.muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5**3)
    for (name, p), q in zip(ref.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_parameters_without_a_gradient_are_left_alone_and_bad_input_is_refused():
    model = tiny_model(seed=0)
    opt = muon_with_adamw(model, muon_lr=0.02, lr=1e-3, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, _ids(0))
    for p in model.parameters():  # what the non-finite guard does to skip a step
        p.grad = None
    opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not opt.muon.state and not opt.adamw.state
    with pytest.raises(ValueError, match="'muon' and 'adamw'"):
        opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    with pytest.raises(ValueError, match="muon_lr and lr must be > 0"):
        muon_with_adamw(model, muon_lr=0.0, lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="2D"):
        MuonWithAdamW([{"params": [model.model.norm.weight]}], [], {"lr": 0.02}, {"lr": 1e-3})


def test_train_hf_trains_with_muon_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    args = parse_args([])
    assert args.muon_lr == DEFAULT_MUON_LR
    assert parse_args(["--muon_lr", "0"]).muon_lr == 0.0
    assert parse_args(["--adamw_8bit"]).muon_lr == 0.0
    with pytest.raises(ValueError, match="--muon_lr 0.02 cannot be combined with --adamw_8bit"):
        parse_args(["--adamw_8bit", "--muon_lr", "0.02"])
    with pytest.raises(ValueError, match="--muon_lr must be a finite number >= 0"):
        parse_args(["--muon_lr", "-1"])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert parse_args([]).muon_lr == 0.0
    with pytest.raises(ValueError, match="cannot be combined with FSDP"):
        parse_args(["--muon_lr", "0.01"])


def test_the_optimizer_is_named_on_the_console_and_the_card():
    from transformers.training_args import OptimizerNames

    from spider_training.optim import describe_optimizer

    assert (
        describe_optimizer(0.01, OptimizerNames.ADAMW_TORCH, muon_experts=True)
        == "Muon (hidden matrices, peak lr 0.01) + adamw_torch"
    )
    assert describe_optimizer(0.0, OptimizerNames.ADAMW_BNB) == "adamw_bnb_8bit"


def test_routed_experts_can_train_with_adamw_instead_of_muon(monkeypatch, tmp_path):
    """`experts=False` (the default run's; ``--muon_experts`` keeps them on Muon): only the routed experts' matrices
    leave Muon (the shared expert and the attention stay) and join AdamW's decayed group; the flag reaches the
    optimizer Trainer builds and its name."""
    from transformers.training_args import OptimizerNames

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.optim import describe_optimizer
    from spider_training.trainer import SpiderTrainer

    model = tiny_model(seed=0)
    named = dict(model.named_parameters())
    everything = {n for n, p in named.items() if is_hidden_matrix(n, p)}
    no_experts = {n for n, p in named.items() if is_hidden_matrix(n, p, experts=False)}
    routed = {n for n in everything if ".mlp.experts." in n}
    assert routed and everything - no_experts == routed
    assert any(".mlp.shared_experts." in n for n in no_experts) and any(".self_attn." in n for n in no_experts)

    def muon_and_decayed(opt):
        muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
        decayed = {id(p) for g in opt.adamw.param_groups if g["weight_decay"] > 0 for p in g["params"]}
        return muon, decayed

    muon, decayed = muon_and_decayed(muon_with_adamw(model, muon_lr=0.02, lr=1e-3, weight_decay=0.1))
    assert muon == {id(named[n]) for n in no_experts} and {id(named[n]) for n in routed} <= decayed
    all_muon, _ = muon_and_decayed(muon_with_adamw(model, muon_lr=0.02, lr=1e-3, weight_decay=0.1, muon_experts=True))
    assert all_muon == {id(named[n]) for n in everything}

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert parse_args([]).muon_experts is False
    assert parse_args(["--muon_experts"]).muon_experts is True
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", muon_lr=0.02
    )
    assert muon_and_decayed(SpiderTrainer(model=model, args=args).create_optimizer())[0] == muon
    trainer = SpiderTrainer(model=model, args=dataclasses.replace(args, muon_experts=True))
    assert muon_and_decayed(trainer.create_optimizer())[0] == all_muon
    assert (
        describe_optimizer(0.01, OptimizerNames.ADAMW_TORCH, muon_experts=False)
        == "Muon (hidden matrices but the routed experts, peak lr 0.01) + adamw_torch"
    )
