"""DDP and FSDP2 at world size 1 on the device at hand: the worker of ``python -m bench.gpu_check``'s ``distributed``
part (``python -m tests.distributed_worker OUT``; ``tests/test_gpu.py`` runs and judges it).

Multi-GPU users train under DDP or FSDP2 (``configs/accelerate/``). This part runs both where a one-GPU session can:
a process group of one rank over NCCL on CUDA (gloo on CPU), in a fresh process
(``python -m tests.distributed_worker OUT``)
so that its process group and accelerate's state stay out of the other parts. On the same batches and from the same
initial weights it trains

- the unwrapped model (the reference),
- the model under ``DistributedDataParallel``,
- the model sharded as ``configs/accelerate/fsdp2.yaml`` shards it (accelerate's own ``fsdp2_prepare_model``: one
  ``fully_shard`` per ``SpiderDecoderLayer`` / ``SpiderRecurrentLayer``, then the root), whose sharded checkpoint is
  written mid-run by accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` (torch distributed checkpoint,
  ``SHARDED_STATE_DICT``, as the Trainer saves it), loaded into a freshly initialised sharded model that trains on,
  and gathered into a release (:func:`spider_training.release.gather_unsharded`) that ``from_pretrained`` loads.

One training step is a user's: bf16 autocast on CUDA, fp32 on CPU, AdamW. The check passes when the DDP and FSDP2
losses equal the reference's, the resumed losses equal the uninterrupted run's, and the release's logits equal the
sharded model's, each within :func:`loss_rtol` (a wrong gradient scale or a lost reduction moves the second loss by
far more). accelerate refuses FSDP without a launcher on CPU (its state stays ``MULTI_CPU``), so
``fsdp2_prepare_model`` is called with :class:`AcceleratorAttributes`, the attributes it reads.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import torch

from spider_training.mixed_precision import autocast_experts

REPO = Path(__file__).resolve().parents[1]
FSDP2_CONFIG = REPO / "configs" / "accelerate" / "fsdp2.yaml"


def spider_model(preset: str, seed: int = 0):
    """A freshly initialised ``SpiderForConditionalGeneration`` of `preset`, seeded."""
    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration

    torch.manual_seed(seed)
    return SpiderForConditionalGeneration(SpiderConfig.from_preset(preset))


class AcceleratorAttributes(SimpleNamespace):
    """What accelerate's ``fsdp2_prepare_model`` and ``save/load_fsdp_model`` read of an ``Accelerator`` (whose state
    refuses FSDP on CPU), for the current process group: build it with :meth:`for_fsdp2`; a test double of the
    ``Accelerator``. Also used by ``tests/fsdp2_worker.py`` (FSDP2 on two CPU processes)."""

    @classmethod
    def for_fsdp2(cls, plugin, device: torch.device) -> AcceleratorAttributes:
        """The attributes for `plugin` (accelerate's ``FullyShardedDataParallelPlugin``, FSDP2) on `device`, with rank
        and world size from the initialised ``torch.distributed`` process group; no mixed precision."""
        import torch.distributed as dist

        return cls(
            state=SimpleNamespace(fsdp_plugin=plugin),
            torch_device_mesh=None,
            mixed_precision="no",
            is_main_process=dist.get_rank() == 0,
            device=device,
            num_processes=dist.get_world_size(),
            process_index=dist.get_rank(),
            is_fsdp2=True,
            wait_for_everyone=dist.barrier,
        )


def loss_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance of two losses computed by the same math in another order: 4 roundings of `dtype`
    (bf16 3.1e-2, fp32 4.8e-7) and at least 1e-5 (fp32 reductions over a model's depth)."""
    return max(4 * torch.finfo(dtype).eps, 1e-5)


def fsdp2_plugin(config_path: Path = FSDP2_CONFIG):
    """accelerate's ``FullyShardedDataParallelPlugin`` with the settings of `config_path`'s ``fsdp_config`` (the
    keys ``accelerate launch`` turns into ``FSDP_*`` variables)."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp = yaml.safe_load(config_path.read_text())["fsdp_config"]
    return FullyShardedDataParallelPlugin(
        fsdp_version=fsdp["fsdp_version"],
        auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
        transformer_cls_names_to_wrap=fsdp["fsdp_transformer_layer_cls_to_wrap"].split(","),
        state_dict_type=fsdp["fsdp_state_dict_type"],
        reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
        cpu_ram_efficient_loading=fsdp["fsdp_cpu_ram_efficient_loading"],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(model, batches, device: torch.device, optimizer=None) -> tuple[list[float], torch.optim.Optimizer]:
    """One step per batch (``(B, L)`` byte ids), the experts in bf16 under autocast as the trainer runs them; returns
    the losses and the optimizer (made if None)."""
    autocast_experts(model)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, optimizer


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def run_world_size_1(out_dir: Path, preset: str = "tiny", steps: int = 4, shape: tuple[int, int] = (4, 64)) -> dict:
    """The check's body (see the module docstring), in this process: initialises and destroys a one-rank process
    group. Returns the figures: losses of each run, their largest relative differences, the tolerance, what was
    sharded, the checkpoint's files and whether the release loaded. Raises what training or loading raises."""
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils.fsdp_utils import (
        fsdp2_prepare_model,
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from modeling_spider import SpiderForConditionalGeneration
    from spider_training.release import gather_unsharded

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL and DDP want the index
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        PartialState(cpu=device.type != "cuda")  # accelerate's checkpoint helpers read its state
        g = torch.Generator().manual_seed(1234)
        data = [torch.randint(32, 127, shape, generator=g).to(device) for _ in range(steps + 2)]
        initial = spider_model(preset).to(device)
        reference, _ = _train(copy.deepcopy(initial), data, device)
        ddp_model = DistributedDataParallel(
            copy.deepcopy(initial), device_ids=[device.index] if device.type == "cuda" else None
        )
        ddp, _ = _train(ddp_model, data, device)
        del ddp_model

        plugin = fsdp2_plugin()
        attributes = AcceleratorAttributes.for_fsdp2(plugin, device)
        sharded = fsdp2_prepare_model(attributes, copy.deepcopy(initial))
        units = sorted(
            type(m).__name__ for m in sharded.modules() if type(m).__name__.startswith("FSDP") and m is not sharded
        )
        fsdp, optimizer = _train(sharded, data[:steps], device)
        checkpoint = out_dir / "sharded_checkpoint"
        save_fsdp_model(plugin, attributes, sharded, str(checkpoint))
        save_fsdp_optimizer(plugin, attributes, optimizer, sharded, str(checkpoint))
        continued, _ = _train(sharded, data[steps:], device, optimizer)
        resumed_model = fsdp2_prepare_model(attributes, spider_model(preset, seed=7).to(device))
        resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=1e-3)
        load_fsdp_model(plugin, attributes, resumed_model, str(checkpoint))
        load_fsdp_optimizer(plugin, attributes, resumed_optimizer, resumed_model, str(checkpoint))
        resumed, _ = _train(resumed_model, data[steps:], device, resumed_optimizer)

        probe = data[0][:2]
        with torch.no_grad():
            resumed_model.eval()
            sharded_logits = resumed_model(input_ids=probe).logits.float().cpu()
        release = gather_unsharded(resumed_model)
        release.save_pretrained(out_dir / "release")
        loaded = SpiderForConditionalGeneration.from_pretrained(out_dir / "release").eval()
        with torch.no_grad():
            release_logits = loaded(input_ids=probe.cpu()).logits
        rtol = loss_rtol(torch.bfloat16 if device.type == "cuda" else torch.float32)
        logits_diff = float((release_logits - sharded_logits).abs().max() / sharded_logits.abs().max())
        return dict(
            device=str(device),
            backend=backend,
            world_size=dist.get_world_size(),
            preset=preset,
            steps=steps,
            shape=f"{shape[0]}x{shape[1]}",
            reference_losses=reference,
            ddp_losses=ddp,
            fsdp2_losses=fsdp + continued,
            resumed_losses=resumed,
            rtol=rtol,
            ddp_max_rel_diff=_max_rel(ddp, reference),
            fsdp2_max_rel_diff=_max_rel(fsdp + continued, reference),
            resumed_max_rel_diff=_max_rel(resumed, continued),
            release_logits_max_rel_diff=logits_diff,
            fsdp2_units=units,
            fsdp2_dtensor_parameters=sum(isinstance(p, DTensor) for p in sharded.parameters()),
            parameters=sum(1 for _ in sharded.parameters()),
            checkpoint_files=sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()),
            release_has_dtensors=any(isinstance(p, DTensor) for p in release.parameters()),
        )
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    """``python -m tests.distributed_worker OUT_DIR [--preset] [--steps] [--shape]``: :func:`run_world_size_1`, its
    figures written to ``OUT_DIR/distributed.json`` and returned."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder for distributed.json, the sharded checkpoint and release")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="steps before the sharded checkpoint (2 more follow)")
    parser.add_argument("--shape", default="4x64", help="BATCHxBYTES per step")
    args = parser.parse_args(argv)
    batch, length = (int(x) for x in args.shape.lower().split("x"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figures = run_world_size_1(args.out_dir, args.preset, args.steps, (batch, length))
    (args.out_dir / "distributed.json").write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
