"""Memory plan for training a Spider preset on 8 GPUs, on paper.

Nothing here runs on a GPU. Each figure comes from the model itself:

- **Parameters, gradients, optimizer states**: parameter counts of the preset built on the meta device. Training
  keeps fp32 master weights and fp32 gradients (torchao FP8 casts a copy per matmul; bf16 autocast likewise), AdamW
  two fp32 states, bitsandbytes' 8-bit AdamW two uint8 states (its block-wise scales, one fp32 per 256 values for
  blocks of 256, add 1/64 of a byte per value: counted). DDP replicates all of it on every GPU; FSDP2 keeps 1/N of it
  plus, while a layer runs, that layer's unsharded parameters and gradients (the largest shard group, twice: FSDP2
  prefetches the next group's all-gather).
- **Activations**: the bytes autograd saves for the backward pass, measured by running the preset's forward on CPU
  under ``torch.autograd.graph.saved_tensors_hooks`` (parameters and repeated saves of one storage not counted) at two
  short sequence lengths and extrapolated linearly to the target length (SDPA's flash kernels save `O(L)` per
  layer, so nothing grows faster). Segments close at the boundary prior's rate (a fixed stride of
  ``round(1 / boundary_prior)`` bytes, the rate training holds them to), and the recurrent block runs the most loops
  a training step runs with the default arguments (``n_loops + extra_train_loops``,
  :class:`spider_training.arguments.SpiderTrainingArguments`), the step that sets the peak. With activation
  checkpointing (``gradient_checkpointing_enable``; every prelude, recurrent and coda layer is a
  ``GradientCheckpointingLayer``) what stays is what the non-checkpointed parts save, the inputs of every checkpointed
  layer call, and one layer's activations while it is recomputed in the backward pass (the largest, measured per layer
  call). Activations are measured in fp32 (the CPU run) and reported for bf16 autocast at half that (FP8 saves its
  inputs in bf16 too).
  Measured on an H200 (docs/results.md, after the plan) a step held 1.5x these activations with checkpointing and
  1.7x without: autocast also keeps the fp32 inputs of what it casts, and the experts' bf16 weight copies.
- **FLOPs per training step** of one sequence: counted by ``FlopCounterMode``
(:func:`spider_training.throughput.count_flops`) for a
  forward and backward at the same two lengths, extrapolated with ``a L + b L^2`` (attention). No throughput is
  derived from them: a CPU's MFU says nothing of a GPU's, and ``python -m bench.gpu_check`` measures the step on a
  GPU.

Usage: :func:`run` (the command ``spider-memory-plan [--preset 1b] [--seq_len 2048] [--gpus 8] [--out F.json]
[--markdown]``, :mod:`spider_training.commands.memory_plan`, runs it: about 3 minutes for the 1b preset on 2 cores;
``python -m bench.memory_plan ... --write_results docs/results.md`` fills docs/results.md's block) and :func:`render`
(the Markdown table).
"""

from __future__ import annotations

import textwrap
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch and the model are imported where a plan is computed: rendering a saved plan (``spider-memory-plan --report``,
# ``python -m bench.memory_plan --report``) needs neither

GIB = 1024**3
GPU_MEMORY_GIB = 80  # H100 / A100 80 GB (B200: 180 GB)
PROBE_LENGTHS = (128, 256)


def meta_model(preset: str, **overrides):
    import torch

    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration

    with torch.device("meta"):
        return SpiderForConditionalGeneration(SpiderConfig.from_preset(preset, **overrides))


def shard_groups(model) -> dict[str, int]:
    """Parameter count of every FSDP2 shard group configs/accelerate/fsdp2.yaml makes: one per
    ``SpiderDecoderLayer`` / ``SpiderRecurrentLayer``, the rest (root) together."""
    names = set(type(model)._no_split_modules)
    groups, covered = {}, set()
    for name, module in model.named_modules():
        if type(module).__name__ in names:
            groups[name] = sum(p.numel() for p in module.parameters())
            covered.update(id(p) for p in module.parameters())
    groups["root"] = sum(p.numel() for p in model.parameters() if id(p) not in covered)
    return groups


def static_bytes(parameters: int, largest_group: int, gpus: int) -> dict[str, dict[str, float]]:
    """Bytes per GPU of weights, gradients and optimizer states: ``{"ddp"|"fsdp2": {...}}``."""
    adamw, adamw_8bit = 8 * parameters, (2 + 2 / 64) * parameters
    ddp = {"parameters": 4 * parameters, "gradients": 4 * parameters, "adamw": adamw, "adamw_8bit": adamw_8bit}
    gathered = 2 * 4 * largest_group  # one group's unsharded fp32 weights and gradients, and the prefetched next one
    fsdp = {
        "parameters": 4 * parameters / gpus + gathered,
        "gradients": 4 * parameters / gpus + 4 * largest_group,
        "adamw": adamw / gpus,
        "adamw_8bit": adamw_8bit / gpus,
    }
    return {"ddp": ddp, "fsdp2": fsdp}


class SavedActivations:
    """Counts the bytes autograd saves for backward (a ``saved_tensors_hooks`` pair), once per storage, without
    parameters, attributed to the checkpointable layer call running at the time (``"other"`` outside any)."""

    def __init__(self, model):
        self.model = model
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.by_call: dict[str, int] = {}
        self.layer_inputs = 0
        self.stack = ["other"]
        self.handles = []

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.param_storages and key not in self.seen and storage.nbytes() > 0:
            self.seen.add(key)
            self.by_call[self.stack[-1]] = self.by_call.get(self.stack[-1], 0) + storage.nbytes()
        return t

    def __enter__(self):
        import torch
        from transformers.modeling_layers import GradientCheckpointingLayer

        calls = {"n": 0}

        def pre(module, args):
            calls["n"] += 1
            self.stack.append(f"{type(module).__name__}#{calls['n']}")
            self.layer_inputs += args[0].numel() * args[0].element_size()  # what a checkpoint keeps of this call

        def post(module, args, out):
            self.stack.pop()

        for m in self.model.modules():
            if isinstance(m, GradientCheckpointingLayer):
                self.handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()


def training_loops_max(preset: str) -> int:
    """The most recurrent loops a training step of `preset` runs with the default arguments: the preset's ``n_loops``
    plus ``SpiderTrainingArguments.extra_train_loops`` (each step draws its count from ``n_loops .. n_loops +
    extra``)."""
    from configuration_spider import SpiderConfig
    from spider_training.arguments import SpiderTrainingArguments

    return SpiderConfig.from_preset(preset).n_loops + SpiderTrainingArguments.extra_train_loops


def probe(preset: str, length: int, seed: int = 0, n_loops: int | None = None) -> dict[str, float]:
    """One sequence of `length` bytes through the preset on CPU (fp32) at `n_loops` recurrent loops (None: the
    preset's): saved-activation bytes without and with checkpointing, and the FLOPs of a forward + backward."""
    import torch

    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration
    from spider_training.throughput import count_flops

    cfg = SpiderConfig.from_preset(
        preset, boundary_mode="fixed"
    )  # segments at the prior's rate, as training holds them
    torch.manual_seed(seed)
    model = SpiderForConditionalGeneration(cfg).train()
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))
    saved = SavedActivations(model)

    def step():  # one forward + backward, counted for FLOPs and for what the forward saves
        with saved:
            loss = model(input_ids=ids, labels=ids, n_loops=n_loops).loss
        loss.backward()

    flops = count_flops(step)["total"]
    full = sum(saved.by_call.values())
    largest_call = max((v for k, v in saved.by_call.items() if k != "other"), default=0)
    checkpointed = saved.by_call.get("other", 0) + saved.layer_inputs + largest_call
    return {"length": length, "activations": full, "activations_checkpointed": checkpointed, "flops": flops}


def extrapolate(probes: list[dict], key: str, length: int, quadratic: bool = False) -> float:
    """Fit `key` over the probe lengths (linear, or ``a L + b L^2`` through the origin) and evaluate at `length`."""
    (l1, y1), (l2, y2) = [(p["length"], p[key]) for p in probes]
    if quadratic:  # y = a L + b L^2
        b = (y2 / l2 - y1 / l1) / (l2 - l1)
        a = y1 / l1 - b * l1
        return a * length + b * length**2
    slope = (y2 - y1) / (l2 - l1)
    return y1 + slope * (length - l1)


def run(preset: str = "1b", seq_len: int = 2048, gpus: int = 8) -> dict:
    """The plan of `preset` (see the module docstring): parameters, shard groups, static bytes per GPU, the probes,
    activations per sequence and FLOPs extrapolated to `seq_len`, and for DDP and FSDP2 over `gpus` GPUs with AdamW
    and 8-bit AdamW, with and without activation checkpointing, the largest micro-batch that fits 80 GB."""
    start = time.perf_counter()
    model = meta_model(preset)
    parameters = sum(p.numel() for p in model.parameters())
    groups = shard_groups(model)
    largest = max(v for k, v in groups.items() if k != "root")
    static = static_bytes(parameters, max(largest, groups["root"]), gpus)
    loops = training_loops_max(preset)
    probes = [probe(preset, n, n_loops=loops) for n in PROBE_LENGTHS]
    # fp32 measurement -> bf16 autocast (half the bytes), one sequence of seq_len
    act = {
        "none": extrapolate(probes, "activations", seq_len) / 2,
        "checkpointing": extrapolate(probes, "activations_checkpointed", seq_len) / 2,
    }
    flops_per_sequence = extrapolate(probes, "flops", seq_len, quadratic=True)
    plans = []
    for strategy in ("ddp", "fsdp2"):
        for optimizer in ("adamw", "adamw_8bit"):
            fixed = static[strategy]["parameters"] + static[strategy]["gradients"] + static[strategy][optimizer]
            for ckpt, per_seq in act.items():
                fits = int((GPU_MEMORY_GIB * GIB - fixed) // per_seq) if fixed < GPU_MEMORY_GIB * GIB else 0
                plans.append(
                    {
                        "strategy": strategy,
                        "optimizer": optimizer,
                        "activation_checkpointing": ckpt,
                        "static_gib": fixed / GIB,
                        "activations_gib_per_sequence": per_seq / GIB,
                        "largest_micro_batch_80gb": fits,
                    }
                )
    return {
        "benchmark": "memory_plan",
        "preset": preset,
        "seq_len": seq_len,
        "gpus": gpus,
        "parameters": parameters,
        "n_loops": loops,
        "shard_groups": groups,
        "static_bytes": static,
        "probes": probes,
        "activation_bytes_per_sequence_bf16": act,
        "train_flops_per_sequence": flops_per_sequence,
        "plans": plans,
        "seconds": time.perf_counter() - start,
    }


def _wrap(paragraph: str) -> str:
    """A Markdown paragraph broken at spaces into lines of at most 119 characters (the project's line length)."""
    return textwrap.fill(paragraph, 119, break_long_words=False, break_on_hyphens=False)


def render(result: dict) -> str:
    """The docs/results.md table (Markdown) from a :func:`run` result; its paragraphs wrap at 119 columns, a table row
    stays one line."""
    r = result
    lines = [
        _wrap(
            f"`{r['preset']}` preset, {r['parameters'] / 1e6:.0f}M parameters, sequences of {r['seq_len']} bytes, "
            f"{r['gpus']} GPUs of {GPU_MEMORY_GIB} GB, a training step at {r['n_loops']} loops (`n_loops` plus the "
            "default `--extra_train_loops`; `spider-memory-plan`, `bench/memory_plan.json`):"
        ),
        "",
        "| strategy | optimizer | activation checkpointing | weights + grads + optimizer per GPU | activations per "
        "sequence (bf16) | largest micro-batch in 80 GB |",
        "|---|---|---|---:|---:|---:|",
    ]
    for p in r["plans"]:
        lines.append(
            f"| {p['strategy'].upper() if p['strategy'] == 'ddp' else 'FSDP2'} | "
            f"{'8-bit AdamW' if p['optimizer'] == 'adamw_8bit' else 'AdamW'} | {p['activation_checkpointing']} | "
            f"{p['static_gib']:.1f} GiB | {p['activations_gib_per_sequence']:.2f} GiB | "
            f"{p['largest_micro_batch_80gb']} |"
        )
    lines += [
        "",
        _wrap(
            f"One training step of one {r['seq_len']}-byte sequence at {r['n_loops']} loops costs "
            f"{r['train_flops_per_sequence'] / 1e12:.2f} TFLOP (measured GPU step times: "
            "`python -m bench.gpu_check`). The micro-batch column leaves nothing for the CUDA context, allocator "
            "fragmentation or NCCL buffers: keep 10-20% free."
        ),
    ]
    return "\n".join(lines) + "\n"
