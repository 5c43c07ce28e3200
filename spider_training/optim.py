"""Muon for the hidden matrices, AdamW for everything else, as one optimizer that Trainer and accelerate can drive.

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/; used by modded-nanogpt and the parameter-golf script
``param-golf-train_gpt.py``) replaces each 2-D weight's momentum update by its nearest semi-orthogonal matrix
(5 Newton-Schulz steps). It applies to the matrices inside the transformer layers; embeddings, the LM head, routers,
norms and other vectors stay with AdamW, as in those recipes. Both halves are torch's own optimizers
(``torch.optim.Muon``, ``torch.optim.AdamW``): :class:`MuonWithAdamW` only presents them to ``transformers.Trainer`` as
the single ``torch.optim.Optimizer`` it schedules, clips, checkpoints and steps. :class:`Muon` is torch's with one
change of speed, not of result: torch runs the Newton-Schulz products in bf16, which an AVX2 CPU (CI's) computes ~20x
slower than fp32; there they run in fp32 on bf16-rounded values (:func:`zeropower_via_newtonschulz`).

``experiments.quality`` measures it (README "Model quality"); ``train_hf.py`` uses it by default (``--muon_lr``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch

#: peak learning rate of Muon for the hidden matrices in the default run (README "Model quality": 0.005 and 0.01 give
#: the same held-out bpb at 500 steps, 0.02 is 0.02 worse, 0.05 0.15 worse)
DEFAULT_MUON_LR = 0.01

_LAYER_STACK = re.compile(r"(^|\.)\w*layers\.\d+\.")


def _bf16_matmul_is_native(device: torch.device) -> bool:
    """Whether bfloat16 matrix products run at full speed on `device`: CUDA, and CPUs with AVX512-BF16 or AMX
    (``torch.backends.cpu.get_cpu_capability()``); on an AVX2 CPU a bf16 product is ~20x slower than fp32."""
    return device.type != "cpu" or torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")


def zeropower_via_newtonschulz(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """The semi-orthogonal matrix nearest `grad` (about ``U V^T`` of its SVD), by torch.optim.Muon's quintic
    Newton-Schulz iteration in bfloat16 (Keller Jordan's, https://kellerjordan.github.io/posts/muon/).

    Same steps and rounding as ``torch.optim._muon._zeropower_via_newtonschulz``: every product's inputs and output are
    bfloat16. Where bf16 products are not native (:func:`_bf16_matmul_is_native`: an AVX2 CPU like CI's) each product
    runs in fp32 on the bf16-rounded inputs and is rounded to bf16 after, which is what a bf16 kernel with fp32
    accumulation computes, up to summation order, at fp32 speed.

    Args:
        grad: ``(m, n)`` tensor, any float dtype. Returns: ``(m, n)`` bfloat16 tensor.
    Raises:
        ValueError: `grad` is not 2-D."""
    if grad.dim() != 2:
        raise ValueError(f"Muon orthogonalises 2-D matrices, got a gradient of shape {tuple(grad.shape)}")
    a, b, c = ns_coefficients
    compute = torch.bfloat16 if _bf16_matmul_is_native(grad.device) else torch.float32

    def bf16(t: torch.Tensor) -> torch.Tensor:  # round to bf16, keep computing in `compute`
        return t.to(torch.bfloat16).to(compute)

    x = bf16(grad)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = bf16(x / bf16(x.norm()).clamp(min=eps))  # spectral norm <= 1 (the norm rounded as torch's bf16 one)
    for _ in range(ns_steps):
        gram = bf16(x @ x.T)
        gram_update = bf16(torch.addmm(gram, gram, gram, beta=b, alpha=c))
        x = bf16(torch.addmm(x, gram_update, x, beta=a))
    if grad.size(0) > grad.size(1):
        x = x.T
    return x.to(torch.bfloat16)


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (same arguments, parameter groups and state dict, so checkpoints move between the two)
    whose Newton-Schulz step is :func:`zeropower_via_newtonschulz`: torch's bf16 iteration, at fp32 speed on CPUs
    without native bf16 products (torch's own takes ~20x longer there, 19 s instead of 1.4 s per step of the dense
    baseline in experiments.quality). The update per 2-D parameter ``W`` with gradient ``G`` and momentum buffer ``B``
    (torch's ``_single_tensor_muon``)::

        B <- lerp(B, G, 1 - momentum);  U <- lerp(G, B, momentum) if nesterov else B
        W <- W * (1 - lr * weight_decay) - lr * adjust(W.shape) * NS(U)

    with ``adjust`` = ``sqrt(max(1, rows / cols))`` (``adjust_lr_fn`` None or "original") or ``0.2 * sqrt(max(rows,
    cols))`` ("match_rms_adamw").

    One extension, for the fused MoE experts (``gate_up_proj`` `(E, 2I, D)`, ``down_proj`` `(E, D, I)`): a 3-D
    parameter ``(E, rows, cols)`` is a stack of E matrices, and a parameter group's ``row_blocks`` (default 1) splits
    each matrix's rows into that many equal blocks; ``NS`` and ``adjust`` apply to every block of every matrix on its
    own. With ``row_blocks=2`` on ``gate_up_proj`` (``[gate; up]`` per expert) each expert's gate, up and down
    projections move exactly as their per-expert ``nn.Linear`` weights did before the experts were fused
    (:func:`muon_with_adamw` sets it). torch's Muon refuses any parameter that is not 2-D; this one refuses any that is
    neither 2-D nor 3-D, or whose rows do not split into ``row_blocks``.

    Raises:
        ValueError: torch's argument checks, or a parameter that is neither 2-D nor 3-D (naming its shape).
    """

    def __init__(self, params, **kwargs):
        # torch.optim.Muon's argument checks and defaults, without its 2-D-only parameter check
        defaults = torch.optim.Muon([torch.empty(1, 1)], **kwargs).defaults
        torch.optim.Optimizer.__init__(self, params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon updates 2D matrices or 3D stacks of matrices (one per expert), got a "
                        f"parameter of size {tuple(p.shape)}"
                    )
                if p.shape[-2] % group.get("row_blocks", 1):
                    raise ValueError(
                        f"a parameter of size {tuple(p.shape)} does not split into "
                        f"row_blocks={group['row_blocks']} blocks of rows"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum = float(group["lr"]), group["momentum"]
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                args = group["ns_coefficients"], group["ns_steps"], group["eps"]
                blocks = group.get("row_blocks", 1)
                rows, cols = param.shape[-2] // blocks, param.shape[-1]
                if update.dim() == 2 and blocks == 1:
                    update = zeropower_via_newtonschulz(update, *args)
                else:  # every block of rows of every matrix of the stack, orthogonalised on its own
                    matrices = update.reshape(-1, rows, cols)
                    update = torch.stack([zeropower_via_newtonschulz(m, *args) for m in matrices]).view(param.shape)
                scale = (
                    0.2 * math.sqrt(max(rows, cols))
                    if group["adjust_lr_fn"] == "match_rms_adamw"
                    else math.sqrt(max(1, rows / cols))
                )
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-lr * scale)
        return loss


def is_hidden_matrix(name: str, param: torch.Tensor, experts: bool = True) -> bool:
    """Whether Muon updates the parameter `name`: a 2-D weight inside a layer stack (``layers.N.``,
    ``prelude_layers.N.``, ``recurrent_block.layers.N.``, ``coda_layers.N.``: attention, FFN and shared-expert
    projections), the routed experts' fused 3-D ``.mlp.experts.gate_up_proj`` / ``down_proj`` (stacks of per-expert
    matrices, which :class:`Muon` orthogonalises one expert at a time), or the boundary predictor's hidden layer; not
    embeddings, the LM head, MoE routers, norms, biases or the loop LoRA.
    `experts=False`: not the routed MoE experts either (``.mlp.experts.``; the shared experts stay), which
    then train with AdamW: on a small batch Muon's Newton-Schulz iterations on every expert matrix dominate the step
    (README "Model quality", the MoE experts on AdamW)."""
    routed_expert = ".mlp.experts." in name
    return (
        (param.dim() == 2 or (param.dim() == 3 and routed_expert))
        and ".router." not in name
        and (experts or not routed_expert)
        and (_LAYER_STACK.search(name) is not None or "boundary_predictor.dense" in name)
    )


class MuonWithAdamW(torch.optim.Optimizer):
    """:class:`Muon` (torch's) over `muon_groups` and ``torch.optim.AdamW`` over `adamw_groups`, as one optimizer.

    The two children share their parameter-group dicts with this optimizer's ``param_groups`` (AdamW's first, so
    the learning rate Trainer logs, the first group's, is ``--lr``'s schedule as with AdamW alone), so a
    learning-rate scheduler that sets ``group["lr"]`` sets it for the child that steps the group; every group keeps its
    own ``initial_lr`` ratio, so Muon's peak learning rate follows the same schedule shape as AdamW's. ``step()`` steps
    both; parameters whose ``.grad`` is None are skipped by both (the non-finite guard relies on that).
    ``state_dict()`` is ``{"muon": ..., "adamw": ...}``, the two children's own state dicts.

    Args:
        muon_groups: parameter groups (dicts with ``params``, optionally ``lr``, ``weight_decay``) of 2-D tensors or
            3-D stacks of matrices (see :class:`Muon`).
        adamw_groups: parameter groups for AdamW.
        muon_kwargs: defaults for ``torch.optim.Muon`` (``lr`` required; ``momentum``, ``weight_decay``, ...).
        adamw_kwargs: defaults for ``torch.optim.AdamW`` (``lr`` required; ``betas``, ``weight_decay``, ...).
    Raises:
        ValueError: a Muon parameter that is neither 2-D nor 3-D (the message names its shape), a parameter in both
            halves, or an empty half.
    """

    def __init__(
        self, muon_groups: Iterable[dict], adamw_groups: Iterable[dict], muon_kwargs: dict, adamw_kwargs: dict
    ):
        self.muon = Muon(list(muon_groups), **muon_kwargs)
        self.adamw = torch.optim.AdamW(list(adamw_groups), **adamw_kwargs)
        super().__init__(self.adamw.param_groups + self.muon.param_groups, defaults={})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                f"MuonWithAdamW state dict needs keys 'muon' and 'adamw', got {sorted(state_dict)}: "
                "was the checkpoint written by another optimizer (--muon_lr changed)?"
            )
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.adamw.param_groups + self.muon.param_groups  # the children made new group dicts


def muon_with_adamw(
    model: torch.nn.Module,
    muon_lr: float,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    decay_parameter_names: set[str] | None = None,
    muon_experts: bool = False,
) -> MuonWithAdamW:
    """:class:`MuonWithAdamW` over `model`'s trainable parameters: the hidden matrices (:func:`is_hidden_matrix`) by
    Muon at `muon_lr`, the rest by AdamW at `lr`, with weight decay on `decay_parameter_names` (Trainer's
    ``get_decay_parameter_names``; default: tensors with ``dim >= 2``). The fused experts' ``gate_up_proj`` get their
    own Muon group with ``row_blocks=2`` (see :class:`Muon`). The routed MoE experts' matrices go to AdamW
    unless `muon_experts` (:func:`is_hidden_matrix`'s `experts`; the default since 2026-11-26, README "Model
    quality"). Muon's decoupled decay per step is
    ``lr * weight_decay``: its weight decay is scaled by ``lr / muon_lr`` so that a matrix decays per step as AdamW
    would decay it.

    Raises: ValueError for a non-positive `muon_lr` or `lr`."""
    if not (muon_lr > 0 and lr > 0):
        raise ValueError(f"muon_lr and lr must be > 0, got muon_lr={muon_lr}, lr={lr}")
    muon, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if is_hidden_matrix(name, param, experts=muon_experts):
            muon.append(param)
        else:
            decays = param.dim() >= 2 if decay_parameter_names is None else name in decay_parameter_names
            (decay if decays else no_decay).append(param)
    adamw_groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # the fused experts' [gate; up] matrices: gate and up orthogonalised apart, as their per-expert weights were
    gate_up = {id(p) for n, p in model.named_parameters() if n.endswith(".mlp.experts.gate_up_proj")}
    muon_groups = [
        {"params": [p for p in muon if id(p) not in gate_up]},
        {"params": [p for p in muon if id(p) in gate_up], "row_blocks": 2},
    ]
    return MuonWithAdamW(
        [group for group in muon_groups if group["params"]],
        [group for group in adamw_groups if group["params"]],
        muon_kwargs={"lr": muon_lr, "weight_decay": weight_decay * lr / muon_lr},
        adamw_kwargs={"lr": lr, "betas": betas, "eps": eps},
    )


def scale_learning_rates(optimizer: torch.optim.Optimizer, model: torch.nn.Module, lr_scale_of) -> None:
    """Give each parameter of `optimizer` (a torch optimizer or :class:`MuonWithAdamW`, freshly built) the learning
    rate ``lr_scale_of(name) * `` its group's: a group whose parameters have several multipliers is split into one
    group per multiplier, its other settings kept. Call it before a scheduler reads the groups' initial rates; the
    schedule then scales every group alike (H-Net's per-stage multipliers, arXiv 2507.07955 §3)."""
    names = {id(param): name for name, param in model.named_parameters()}
    for opt in (optimizer.adamw, optimizer.muon) if isinstance(optimizer, MuonWithAdamW) else (optimizer,):
        groups = []
        for group in opt.param_groups:
            by_scale: dict[float, list] = {}
            for param in group["params"]:
                by_scale.setdefault(float(lr_scale_of(names[id(param)])), []).append(param)
            groups += [{**group, "params": params, "lr": group["lr"] * scale} for scale, params in by_scale.items()]
        opt.param_groups = groups
    if isinstance(optimizer, MuonWithAdamW):
        optimizer.param_groups = optimizer.adamw.param_groups + optimizer.muon.param_groups


def describe_optimizer(muon_lr: float, optim, muon_experts: bool = False) -> str:
    """The run's optimizer in words, for the start-up summary and the model card: ``"Muon (hidden matrices but the
    routed experts, peak lr 0.01) + adamw_torch"`` (``"hidden matrices"`` when `muon_experts`), or Trainer's
    ``optim`` name (an ``OptimizerNames`` or str) when `muon_lr` is 0."""
    name = getattr(optim, "value", str(optim))
    which = "hidden matrices" if muon_experts else "hidden matrices but the routed experts"
    return f"Muon ({which}, peak lr {muon_lr:g}) + {name}" if muon_lr else name
