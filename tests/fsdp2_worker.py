"""FSDP2 on CPU: one worker of ``torchrun --nproc_per_node 2 tests/fsdp2_worker.py OUT_DIR`` (gloo backend).

Run by ``tests/test_fsdp2.py`` as ``accelerate launch --config_file configs/accelerate/fsdp2.yaml
--num_processes 2 tests/fsdp2_worker.py OUT_DIR``: the ``FSDP_*`` environment is the shipped config's. accelerate does
not switch to FSDP on CPU (its ``AcceleratorState`` stays
``MULTI_CPU``), so the worker calls accelerate's own ``fsdp2_prepare_model`` with
:class:`tests.distributed_worker.AcceleratorAttributes` (a test
double for the :class:`~accelerate.Accelerator`, exposing the attributes that function reads) and the real
``FullyShardedDataParallelPlugin`` built from that environment: the model is wrapped exactly as the shipped config
wraps it on GPUs (one ``fully_shard`` per ``SpiderDecoderLayer`` / ``SpiderRecurrentLayer``, the embedding and the
output head, then the root).

Every rank trains on its half of each global batch; every rank also trains an unsharded copy the way one process
would on the same global batch (the mean of the two halves' losses, as DDP and FSDP average gradients), so the
test compares the sharded loss curve against the single-process one (and against activation checkpointing, emulated
FP8 and ``--compile``'s compiled layers under FSDP2). Results go to ``OUT_DIR/rank0.json``.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configuration_spider import SpiderConfig  # noqa: E402
from modeling_spider import SpiderForConditionalGeneration  # noqa: E402
from spider_training.release import gather_unsharded  # noqa: E402
from tests.distributed_worker import AcceleratorAttributes  # noqa: E402

STEPS = 3
GLOBAL_BATCH, SEQ_LEN = 4, 48


def make_model(seed: int = 0, **overrides) -> SpiderForConditionalGeneration:
    torch.manual_seed(seed)
    return SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny", **overrides))


def batches(rank: int, world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of printable bytes (the same on every rank); returns (global batch, this rank's half)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        ids = torch.randint(32, 127, (GLOBAL_BATCH, SEQ_LEN), generator=g)
        per_rank = GLOBAL_BATCH // world
        out.append((ids, ids[rank * per_rank : (rank + 1) * per_rank]))
    return out


def shard(model, world: int):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* environment accelerate launch sets
    assert plugin.fsdp_version == 2, plugin.fsdp_version
    stand_in = AcceleratorAttributes.for_fsdp2(plugin, torch.device("cpu"))  # test double for the Accelerator
    return fsdp2_prepare_model(stand_in, model), plugin, stand_in


def train_sharded(model, data, steps) -> tuple[list[float], torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [sharded_step(model, optimizer, local) for _, local in data[:steps]]
    return losses, optimizer


def sharded_step(model, optimizer, local: torch.Tensor) -> float:
    loss = model(input_ids=local, labels=local).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def train_reference(model, data, world: int) -> list[float]:
    """One process, the same global batches: the loss is the mean over the ranks' halves."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids, _ in data:
        halves = ids.chunk(world)
        loss = sum(model(input_ids=h, labels=h).loss for h in halves) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    from accelerate import PartialState

    PartialState(cpu=True)  # accelerate's logging and checkpoint helpers need its state (MULTI_CPU here)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir)
    data = batches(rank, world, STEPS + 2)
    result: dict = {"world_size": world}

    # 1. Sharded training against one process on the same global batches.
    reference = make_model()
    model = copy.deepcopy(reference)
    model, plugin, stand_in = shard(model, world)
    params = dict(model.named_parameters())
    result["dtensor_parameters"] = sum(isinstance(p, DTensor) for p in params.values())
    result["parameters"] = len(params)
    result["sharded_units"] = sorted(
        type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP") and m is not model
    )
    result["state_dict_type"] = str(plugin.state_dict_type)
    result["fsdp_losses"], optimizer = train_sharded(model, data, STEPS)
    result["reference_losses"] = train_reference(reference, data[:STEPS], world)

    # 2. The full state dict gathered to rank 0 makes a release (spider_training.release.gather_unsharded); its logits
    #    are compared in a fresh process.
    probe = data[0][0][:2]
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=probe).logits
        model.train()
    # what train_hf.py does at the end of a run: every rank gathers, rank 0 gets a plain model and writes
    release = gather_unsharded(model)
    if rank == 0:
        result["release_has_dtensors"] = any(isinstance(p, DTensor) for p in release.parameters())
        release.save_pretrained(out / "release")
        torch.save({"input_ids": probe, "logits": logits}, out / "probe.pt")
    else:
        assert release is None, "gather_unsharded gives the model to rank 0 only"

    # 3. A sharded checkpoint, written and read by accelerate's own save/load_fsdp_model and _optimizer (torch
    #    distributed checkpoint, SHARDED_STATE_DICT), resumes the same loss curve: two more steps straight on, and
    #    the same two steps after a load into a freshly initialised sharded model.
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

    save_fsdp_model(plugin, stand_in, model, str(out / "sharded"))
    save_fsdp_optimizer(plugin, stand_in, optimizer, model, str(out / "sharded"))
    result["checkpoint_files"] = sorted(p.name for p in (out / "sharded").iterdir())
    result["continued_losses"] = [sharded_step(model, optimizer, local) for _, local in data[STEPS:]]
    resumed, _, _ = shard(make_model(seed=7), world)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    load_fsdp_model(plugin, stand_in, resumed, str(out / "sharded"))
    load_fsdp_optimizer(plugin, stand_in, resumed_optimizer, resumed, str(out / "sharded"))
    result["resumed_losses"] = [sharded_step(resumed, resumed_optimizer, local) for _, local in data[STEPS:]]

    # 4. Activation checkpointing under FSDP2: the same loss curve as without it.
    checkpointed = make_model()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, _, _ = shard(checkpointed, world)
    result["checkpointed_losses"], _ = train_sharded(checkpointed, data, STEPS)

    # 5. Emulated FP8 (torchao Float8Linear) shards and trains; one process on the same batches for comparison.
    from spider_training.fp8 import convert_for_fp8_training

    fp8_reference = make_model()
    report = convert_for_fp8_training(fp8_reference, emulate=True, layers="tk_train")
    fp8_model = copy.deepcopy(fp8_reference)
    fp8_model, _, _ = shard(fp8_model, world)
    float8 = [m for m in fp8_model.modules() if type(m).__name__ == "Float8Linear"]
    result["fp8_converted"] = len(report.converted)
    result["fp8_dtensor_weights"] = sum(isinstance(m.weight, DTensor) for m in float8)
    result["fp8_losses"], _ = train_sharded(fp8_model, data, STEPS)
    result["fp8_reference_losses"] = train_reference(fp8_reference, data[:STEPS], world)
    fp8_release = gather_unsharded(fp8_model)  # strict load of the gathered FP8 weights into a plain model
    if rank == 0:
        result["fp8_release_plain"] = not any(type(m).__name__ == "Float8Linear" for m in fp8_release.modules())

    # 6. --compile's layers (compiled in place, before sharding, as SpiderTrainer does before accelerate wraps the
    #    model) under FSDP2: the sharding hooks run outside the compiled graphs; the same loss curve as uncompiled.
    from torch._dynamo.utils import counters

    from spider_training.compile import compile_model

    torch._dynamo.reset()
    counters.clear()
    compiled, _, _ = shard(compile_model(make_model(), backend="eager"), world)
    result["compiled_losses"], _ = train_sharded(compiled, data, STEPS)
    result["compiled_graphs"] = int(counters["stats"]["unique_graphs"])

    if rank == 0:
        (out / "rank0.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
    gc.freeze()  # exit without collecting the libraries' objects first (as train_hf.py: 1-3 s per rank)
