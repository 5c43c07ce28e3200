"""FLOP counting for the benchmarks' MFU figures: torch's ``FlopCounterMode`` plus the formulas it lacks on CPU.

:func:`count_flops` runs a call once under the counter; :func:`extra_flop_formulas` adds ``torch._grouped_mm``
(transformers' and Spider's grouped experts) and the CPU flash-attention SDPA kernel, which torch 2.13 counts as 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch



def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm`` FLOPs (2 per multiply-add) for the four 2-D/3-D operand layouts."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # (M, K) x (E, K, N), rows grouped by offs
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 2:  # (E, M, K) x (K, N), columns grouped
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (M, K) x (K, N), K grouped -> (E, M, N)
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]  # batched


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def extra_flop_formulas() -> dict:
    """FLOP formulas torch 2.13's ``FlopCounterMode`` lacks on CPU: ``_grouped_mm`` (transformers' and Spider's
    grouped experts) and the CPU flash-attention SDPA kernel (forward and backward). Without them attention and
    grouped experts would count as 0 FLOPs. Causal attention is counted as full attention, as torch does."""
    aten = torch.ops.aten
    formulas = {aten._grouped_mm: _grouped_mm_flop}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        formulas[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flop
        formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flop
    return formulas


def count_flops(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` once under ``torch.utils.flop_counter.FlopCounterMode`` (plus :func:`extra_flop_formulas`).

    Returns ``{"total": int, "by_op": {op: int}}``. Only matmul-like ops are counted (elementwise ops, norms and the
    optimizer update count 0), as in torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=extra_flop_formulas())
    with counter:
        fn()
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    return {"total": int(counter.get_total_flops()), "by_op": by_op}
