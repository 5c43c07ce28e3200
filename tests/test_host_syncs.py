"""A training step on the `grouped_mm` experts path without per-loop host syncs, one host sync per training step, and
an MoE
layer without any.

On a GPU every op that needs a value on the host (`.item()`, `.tolist()`, a boolean-mask gather, `nonzero`, `bincount`
sizing its output) drains the launch queue. The ops are counted with a `TorchDispatchMode` (the CPU runs the same aten
ops the GPU would, so the count is the GPU's), and `Tensor.tolist` by a wrapper: on a CPU tensor it reads the data
without dispatching an aten op, so the mode alone misses it (on the GPU it is a device-to-host copy). The count must
not grow with the number of recurrent layers or loops, and the MoE layer's forward and backward must have none.
"""

import collections
import pickle

import pytest
import torch

from modeling_spider import SpiderMoE, SpiderRecurrentLayer
from spider_training.profiling import HostSyncCounter
from tests.helpers import float_tol, tiny, tiny_model


def _training_step_syncs(layers: int, loops: int, padded: bool) -> collections.Counter:
    model = tiny_model(
        seed=0, num_recurrent_layers=layers, engram_layer_ids=[0], n_loops=loops, experts_implementation="grouped_mm"
    ).train()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :11] = 0  # left padding: the rows close different numbers of segments
    with HostSyncCounter() as counter:
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
    return counter.counts


@pytest.mark.parametrize("padded", [False, True])
def test_host_syncs_do_not_grow_with_layers_or_loops(padded):
    counts = {
        (layers, loops): _training_step_syncs(layers, loops, padded) for layers, loops in ((1, 1), (2, 3), (6, 6))
    }
    # the 1b preset's depth (6 layers x 6 loops) needed ~330 before; now the same handful as one layer and one loop
    assert counts[(6, 6)] == counts[(1, 1)] == counts[(2, 3)], counts
    assert sum(counts[(6, 6)].values()) <= 8, counts[(6, 6)]
    assert not any("boolean" in name or name == "bincount" for name in counts[(6, 6)]), counts[(6, 6)]


@pytest.mark.parametrize("boundary_mode", ["hard", "relaxed"])
def test_training_step_on_an_accelerator_syncs_once(monkeypatch, boundary_mode):
    """A training forward+backward at the 1b preset's depth (6 layers x 6 loops), rows closing different numbers of
    segments: one host sync, the segment count the recurrent block's shape needs. The value checks of `input_ids`
    and `labels` run as on an accelerator (test double: `value_checks_sync` answers as it does for a CUDA tensor in
    training, so they become `_assert_async`); the segments route without selecting the real rows. No tensor is made
    from host data after the first step (on an accelerator each one is a blocking copy: the Engram hash constants are
    made once per device; the relaxed boundaries sample without `torch.distributions`' argument validation)."""
    import modeling_spider

    monkeypatch.setattr(modeling_spider, "value_checks_sync", lambda tensor, training: not training)
    model = tiny_model(
        seed=0, num_recurrent_layers=6, engram_layer_ids=[0, 3], n_loops=6, boundary_mode=boundary_mode
    ).train()
    ids = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    ids[0, ::3] = ord(" ")  # the rows close different numbers of segments: padding segments in the block
    with HostSyncCounter() as first:
        model(input_ids=ids, labels=ids).loss.backward()
    assert first.counts == {"_local_scalar_dense": 1, "tensor from host data": 3}, first.counts
    with HostSyncCounter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.counts == {"_local_scalar_dense": 1}, counter.counts
    # the checks still catch a bad id: on an accelerator at its next sync, here (CPU) at once
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        model(input_ids=ids.clamp(max=300) + 20, labels=ids)


def test_counter_sees_tolist():
    original = torch.Tensor.tolist
    with HostSyncCounter() as counter:
        torch.arange(3).tolist()
    assert counter.counts == {"tolist": 1}
    assert torch.Tensor.tolist is original  # restored on exit


def test_counter_sees_host_data_entering_the_device():
    """`torch.tensor(data, device=...)` and a blocking host-to-device copy each wait for the stream on an accelerator
    (ATen's `memcpy_and_sync`); the meta device stands in for an accelerator as the copy's target."""
    host = torch.ones(3)
    with HostSyncCounter() as counter:
        torch.tensor([1, 2, 3])
        host.to("meta")
        host.to("meta", non_blocking=True)  # asynchronous: no sync
        host * 2  # no host data enters
    assert counter.counts == {"tensor from host data": 1, "copy to device": 1}, counter.counts


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_layer_forward_and_backward_have_no_host_sync(implementation, dtype):
    """Routing (softmax, top-k, renormalisation, aux_fi) and the experts, forward and backward: zero host syncs, so
    none of the training step's remaining syncs is the MoE's (the old "sorted" path had one `.tolist()` per layer and
    loop: 36 of 44 per step on the 1b preset)."""
    torch.manual_seed(0)
    moe = SpiderMoE(tiny(experts_implementation=implementation, n_routed_experts=8)).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(37, moe.config.hidden_size, dtype=dtype, requires_grad=True)
    with HostSyncCounter() as counter:
        out, logits, load, scores = moe(x)
        (out.float().square().sum() + (load * scores).sum()).backward()
    assert counter.counts == {}, counter.counts
    assert x.grad is not None and moe.experts.gate_up_proj.grad is not None


def test_packed_moe_rows_match_boolean_mask_routing():
    """The recurrent layer routes the non-padding segments by index; outputs and gradients equal routing them through
    a boolean mask (the previous implementation, written out here)."""
    config = tiny(experts_implementation="grouped_mm")
    torch.manual_seed(0)
    layer = SpiderRecurrentLayer(config, 0, memory_size=8)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    B, S, D = 2, 7, config.hidden_size
    hidden = torch.randn(B, S, D, requires_grad=True)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 5:] = False
    index = mask.reshape(-1).nonzero().squeeze(1)
    rope = (torch.ones(B, S, config.qk_rope_head_dim), torch.zeros(B, S, config.qk_rope_head_dim))
    attention_mask = (torch.ones(S, S, dtype=torch.bool).tril()[None] & mask[:, None, :])[:, None]
    attention_mask = attention_mask | torch.eye(S, dtype=torch.bool)[None, None]

    out, logits, aux, load = layer(hidden, rope, attention_mask, index)

    def reference(h):
        h = h + layer.self_attn(layer.input_layernorm(h), rope, attention_mask)[0]
        moe_out, ref_logits, ref_aux, ref_load = layer.mlp(layer.post_attention_layernorm(h)[mask])
        return h.index_put((mask,), h[mask] + moe_out), ref_logits, ref_aux, ref_load

    ref, ref_logits, ref_aux, ref_load = reference(hidden)
    assert torch.equal(out, ref) and torch.equal(logits, ref_logits)
    assert torch.equal(aux, ref_aux) and torch.equal(load, ref_load)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), [hidden, *layer.parameters()])
    ref_grads = torch.autograd.grad((ref * upstream).sum(), [hidden, *layer.parameters()])
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, **float_tol(ref_grad, terms=B * S * D))


def test_recurrent_block_compiles_without_graph_breaks():
    """`torch._dynamo.explain` of the recurrent block (grouped_mm experts, padded segments routed by index) finds one
    graph and no break. bf16: torch's meta kernel of `_grouped_mm`, which tracing runs, accepts bf16 only (GPUs run
    grouped_mm in bf16; the fp32 eager CPU kernel has no such limit)."""
    model = tiny_model(seed=0, experts_implementation="grouped_mm").train().to(torch.bfloat16)
    block, config = model.model.recurrent_block, model.config
    B, S = 2, 9
    segments = torch.randn(B, S, config.hidden_size, dtype=torch.bfloat16)
    rope = model.model.rotary_emb(segments, torch.arange(S).expand(B, S))
    memory = torch.randn(B, S, model.model.engram_embeddings.output_size, dtype=torch.bfloat16)
    index = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12])  # row 1 holds 4 real segments
    explanation = torch._dynamo.explain(block)(segments, rope, None, index, memory, config.n_loops)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert explanation.graph_count == 1


class _GroupedMMDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operand dtypes of every ``aten._grouped_mm`` call, forward and backward."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._grouped_mm:
            self.dtypes.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_grouped_experts_run_in_the_autocast_dtype():
    """Under bf16 autocast with fp32 master weights every grouped GEMM of the experts, forward and backward, gets bf16
    operands: torch's CUDA grouped GEMM takes its fast kernel only for bf16 operands, and otherwise falls back to a
    loop
    over the groups that reads the offsets on the host (aten/native/cuda/GroupedBlas.cpp). torch's grouped GEMM is no
    autocast op, so the fp32 weights set the dtype of the model alone; the trainer's
    ``spider_training.mixed_precision.autocast_experts`` casts. The gradients reach the fp32 weights, and the output
    stays within bf16 rounding of the fp32 one."""
    from spider_training.mixed_precision import autocast_experts

    torch.manual_seed(0)
    moe = SpiderMoE(tiny(experts_implementation="grouped_mm", n_routed_experts=8))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(37, moe.config.hidden_size, requires_grad=True)
    reference = moe(x)[0].detach()
    with _GroupedMMDtypes() as alone, torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert set(alone.dtypes) == {(torch.float32, torch.float32)}, alone.dtypes
    assert autocast_experts(moe) == 1
    with _GroupedMMDtypes() as in_copy, torch.autocast("cpu", dtype=torch.bfloat16):
        pickle.loads(pickle.dumps(moe))(x)  # the forward it sets travels with the module (torch.save, deepcopy)
    assert set(in_copy.dtypes) == {(torch.bfloat16, torch.bfloat16)}, in_copy.dtypes
    with _GroupedMMDtypes() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)[0]
        out.float().square().sum().backward()
    assert seen.dtypes and set(seen.dtypes) == {(torch.bfloat16, torch.bfloat16)}, seen.dtypes
    assert len(seen.dtypes) >= 4  # two projections forward, their input gradients backward (and weight gradients)
    grad = moe.experts.gate_up_proj.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0
    # bf16 operands: each product carries a relative rounding of up to 2 * 2^-8, over the projections' inner sizes
    bf16 = float_tol(reference.to(torch.bfloat16), terms=moe.config.hidden_size + moe.config.moe_intermediate_size)
    torch.testing.assert_close(out.float(), reference, rtol=bf16["rtol"], atol=bf16["atol"])


def test_router_runs_in_fp32_under_autocast():
    """The router's logits under bf16 autocast are the fp32 matmul's, bit for bit (DeepSeek-V3 keeps its gating in full
    precision; autocast alone would round the operands to bf16), and its gradient reaches the fp32 weight."""
    torch.manual_seed(0)
    moe = SpiderMoE(tiny(n_routed_experts=8))
    x = torch.randn(37, moe.config.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = moe.route(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(x, moe.router.weight))
    rounded = torch.nn.functional.linear(x.bfloat16(), moe.router.weight.bfloat16()).float()
    assert not torch.equal(logits, rounded)  # what autocast would have given
    logits.square().sum().backward()
    assert moe.router.weight.grad.dtype == torch.float32 and moe.router.weight.grad.abs().sum() > 0


def test_moe_routes_on_the_meta_device():
    """A forward on meta tensors (shape tracing without memory) passes the autocast checks: autocast does not know the
    meta device type, and the router and experts then take their plain path. (bf16: torch's meta kernel of
    `_grouped_mm` takes bf16 operands only.)"""
    with torch.device("meta"):
        moe = SpiderMoE(tiny(n_routed_experts=8)).to(torch.bfloat16)
        out, logits, _, _ = moe(torch.empty(5, moe.config.hidden_size, dtype=torch.bfloat16))
    assert out.shape == (5, moe.config.hidden_size) and out.is_meta
    assert logits.shape == (5, 8) and logits.dtype == torch.float32
