"""Atomic checkpoint folders: write into a staging folder, then publish it with one ``os.replace``.

A training checkpoint is a complete HF folder (``checkpoint-N``: safetensors weights, config with ``auto_map``, the
model/tokenizer code, tokenizer files, optimizer/scheduler/RNG/trainer state). It is written under
``OUTPUT_DIR/.staging/`` and renamed into place only once every file is on disk, so a ``checkpoint-N`` folder is
always complete: a crash mid-write leaves only staging debris, which the next save clears and which
``transformers.trainer_utils.get_last_checkpoint`` never picks (its name does not match ``checkpoint-N``).

A save that fails for lack of space or on a read-only filesystem raises :class:`CheckpointWriteError`, which names the
folder and the cause (:func:`describe_write_failure`); the published checkpoints are untouched (rotation runs only
after a successful publish) and the staging debris is removed by the next save.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch

STAGING_DIRNAME = ".staging"


#: a per-expert weight of older releases: prefix (ending in "experts."), expert index, projection
PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fuse_per_expert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` with every per-expert group (``P.experts.{e}.gate_proj.weight`` etc.) fused into
    ``modeling_spider.SpiderExperts``' ``P.experts.gate_up_proj`` `(E, 2I, D)` and ``down_proj`` `(E, D, I)`, other
    keys in order (the ``load_state_dict`` counterpart of ``modeling_spider.per_expert_checkpoint_conversions``).

    Raises:
        ValueError: an incomplete group (an expert index or a projection missing), naming the prefix.
    """
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, value in state_dict.items():
        match = PER_EXPERT_KEY.match(key)
        if match:
            groups.setdefault(match["prefix"], {})[int(match["e"]), match["proj"]] = value
    if not groups:
        return dict(state_dict)
    fused: dict[str, torch.Tensor] = {}
    for prefix, weights in groups.items():
        num_experts = 1 + max(e for e, _ in weights)
        missing = [
            (e, p) for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in weights
        ]
        if missing:
            raise ValueError(
                f"per-expert weights under {prefix!r} are incomplete: missing "
                + ", ".join(f"{prefix}{e}.{p}.weight" for e, p in missing[:5])
            )
        fused[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([weights[e, "gate_proj"], weights[e, "up_proj"]], dim=0) for e in range(num_experts)]
        )
        fused[prefix + "down_proj"] = torch.stack([weights[e, "down_proj"] for e in range(num_experts)])
    out, placed = {}, set()
    for key, value in state_dict.items():
        match = PER_EXPERT_KEY.match(key)
        if not match:
            out[key] = value
        elif match["prefix"] not in placed:  # the fused pair takes the place of the group's first key
            placed.add(match["prefix"])
            out[match["prefix"] + "gate_up_proj"] = fused[match["prefix"] + "gate_up_proj"]
            out[match["prefix"] + "down_proj"] = fused[match["prefix"] + "down_proj"]
    return out


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only filesystem, no permission, ...).

    ``errno`` is the underlying error number (``errno.ENOSPC``, ``errno.EROFS``, ...; ``errno.EIO`` when unknown),
    ``path`` the checkpoint folder being written."""

    def __init__(self, number: int, message: str, path: str):
        super().__init__(number, message)
        self.path = path


_CAUSES = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded (disk full for this user)",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied (read-only directory?)",
    errno.EPERM: "operation not permitted (read-only or immutable directory?)",
}
_MESSAGES = {
    "No space left on device": errno.ENOSPC,
    "os error 28": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
    "os error 30": errno.EROFS,
    "Permission denied": errno.EACCES,
}
LOW_SPACE_BYTES = 1 << 20
"""Free space under which a write failure of unknown cause is reported as "disk full" (1 MiB)."""


def _find_errno(err: BaseException | None) -> int | None:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _CAUSES:
            return err.errno
        for text, number in _MESSAGES.items():  # torch.save / safetensors raise RuntimeError-like errors
            if text in str(err):
                return number
        err = err.__cause__ or err.__context__
    return None


def describe_write_failure(path: str | os.PathLike, err: BaseException) -> tuple[int | None, str]:
    """Why writing under `path` failed: ``(errno or None, human-readable cause)``.

    Looks at the errno / message of `err` and its chain (``torch.save`` and safetensors wrap the OS error in a
    ``RuntimeError`` / ``SafetensorError``), then at the filesystem of `path` (``statvfs``: read-only flag, free bytes
    below :data:`LOW_SPACE_BYTES`). Never raises."""
    number = _find_errno(err)
    if number is not None:
        return number, _CAUSES[number]
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stats = os.statvfs(probe)
    except OSError:
        return None, f"{type(err).__name__}: {err}"
    if stats.f_flag & os.ST_RDONLY:
        return errno.EROFS, _CAUSES[errno.EROFS]
    free = stats.f_bavail * stats.f_frsize
    if free < LOW_SPACE_BYTES:
        return errno.ENOSPC, f"disk full ({free} bytes free)"
    return None, f"{type(err).__name__}: {err}"


def checkpoint_write_error(
    folder: str | os.PathLike, err: BaseException, previous: str | None
) -> CheckpointWriteError:
    """The :class:`CheckpointWriteError` to raise when writing `folder` failed with `err` (`previous`: newest intact
    checkpoint, named in the message)."""
    number, cause = describe_write_failure(folder, err)
    keep = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointWriteError(
        number if number is not None else errno.EIO,
        f"could not write checkpoint {folder}: {cause}; {keep}. Original error: {err}",
        str(folder),
    )


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def publish(staged: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the finished folder `staged` to `final` atomically (same filesystem), replacing an older `final`.

    Raises:
        FileNotFoundError: `staged` does not exist.
        OSError: the rename failed (the message names both paths); `final`'s previous content is kept.
    """
    staged, final = Path(staged), Path(final)
    if not staged.is_dir():
        raise FileNotFoundError(f"staged checkpoint folder {staged} does not exist")
    _fsync_tree(staged)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(staged, final)
    except OSError as err:
        if old is not None:
            os.replace(old, final)
        raise OSError(f"could not publish checkpoint {staged} -> {final}: {err}") from err
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    parent_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(parent_fd)
    finally:
        os.close(parent_fd)
    return final


def clear_staging(output_dir: str | os.PathLike) -> Path:
    """Remove leftovers of an interrupted save and return the (absent) staging folder of `output_dir`."""
    staging = Path(output_dir) / STAGING_DIRNAME
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """Newest ``checkpoint-N`` folder of `output_dir` (what auto-resume picks), or None when there is none or the
    folder does not exist: ``transformers.trainer_utils.get_last_checkpoint``, which is exact here because a
    ``checkpoint-N`` folder is only ever published complete (see the module docstring)."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(output_dir)) if os.path.isdir(output_dir) else None


def write_json(path: str | os.PathLike, result, indent: int = 1) -> None:
    """`result` as JSON at `path` (values JSON lacks as ``str``), atomically (a temporary file beside it, then one
    ``os.replace``): a reader, or a run killed mid-write, never sees half a file. The commands' ``--out`` files and
    bench's runners write with it."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=indent, default=str) + "\n")
    os.replace(tmp, target)


def save_folder_atomically(final: str | os.PathLike, write) -> Path:
    """Call ``write(tmp_folder)`` to fill a fresh sibling temp folder, then publish it as `final`.

    Used for the release folder. Raises whatever `write` raises (the temp folder is removed, `final` untouched).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, final)


#: What a checkpoint records of how its run split the data: a resume must split it the same way.
DATA_LAYOUT_NAME = "spider_data_layout.json"


def data_layout(args) -> dict[str, int]:
    """How a run with ``TrainingArguments`` `args` splits the data: processes, windows per process and micro-batch,
    micro-batches per optimizer step (what :data:`DATA_LAYOUT_NAME` records)."""
    return {
        "world_size": args.world_size,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    }


def write_data_layout(folder: str | os.PathLike, layout: dict[str, int]) -> None:
    """Record in checkpoint `folder` the :func:`data_layout` of the run writing it (:data:`DATA_LAYOUT_NAME`)."""
    (Path(folder) / DATA_LAYOUT_NAME).write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")


def check_data_layout(folder: str | os.PathLike, layout: dict[str, int]) -> None:
    """Refuse to resume from checkpoint `folder` with another :func:`data_layout` (`layout`) than the run that wrote
    it.

    The windows a step trains on follow the process count, the micro-batch and the accumulation (Trainer's sampler
    splits the shuffled order across processes and skips the consumed batches by count), so resuming with any of them
    changed would skip some windows of the epoch and repeat others, silently. A checkpoint without the record
    (written before it existed) is not checked.

    Raises:
        ValueError: the layout differs; the message names both and how to resume.
    """
    path = Path(folder) / DATA_LAYOUT_NAME
    if not path.is_file():
        return
    saved, now = json.loads(path.read_text(encoding="utf-8")), layout
    if saved != now:

        def describe(layout: dict) -> str:
            return (
                f"{layout['world_size']} process(es) x {layout['per_device_train_batch_size']} windows x "
                f"{layout['gradient_accumulation_steps']} accumulation step(s)"
            )

        raise ValueError(
            f"{folder} was written by a run of {describe(saved)}; this run has {describe(now)}. Resuming would skip "
            "some windows of the epoch and repeat others (the order of the windows follows that layout). Resume "
            "with the same process count, --micro_batch/--per_device_train_batch_size and --grad_accum, or start a "
            f"new run from its weights with --init_from {folder} (a new data order)."
        )


#: Where a checkpoint holds each rank's position in a streamed source (``{rank}``: the process index).
STREAM_POSITION_NAME = "spider_stream_position_{rank}.json"


def write_stream_position(folder: str | os.PathLike, rank: int, state: dict) -> None:
    """Record in checkpoint `folder` rank `rank`'s position in its streamed source (the JSON of
    :meth:`spider_training.data.StreamingTextDataset.state_dict`), :data:`STREAM_POSITION_NAME`."""
    Path(folder).mkdir(parents=True, exist_ok=True)  # another rank may not have created the staged folder yet
    path = Path(folder) / STREAM_POSITION_NAME.format(rank=rank)
    path.write_text(json.dumps(state) + "\n", encoding="utf-8")


def read_stream_position(folder: str | os.PathLike, rank: int) -> dict | None:
    """Rank `rank`'s saved stream position in checkpoint `folder` (:func:`write_stream_position`), or None when the
    checkpoint has none (written by a run with dataloader workers, or before positions were saved)."""
    path = Path(folder) / STREAM_POSITION_NAME.format(rank=rank)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def convert_older_checkpoint(folder: str | os.PathLike) -> bool:
    """Rewrite `folder`'s ``model.safetensors`` once in today's names when it holds an older checkpoint's: the
    per-expert layout (``...experts.{e}.gate_proj.weight`` etc.; :func:`fuse_per_expert_state_dict`) fused, the
    segmentation's older names (``null_group``, ``down_norm``,
    ``upsample_norm``: ``conversion_spider.OLDER_SEGMENTATION_KEYS``) renamed, so that Trainer's resume, which reads
    the
    file with ``load_state_dict``, finds every weight. The new file replaces the old with one ``os.replace`` (a crash
    leaves the old file).

    Returns: True when the file was rewritten; False for a current, sharded or missing file.
    Raises: ValueError for an incomplete per-expert group (naming the missing keys)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from conversion_spider import OLDER_SEGMENTATION_KEYS

    def older(key: str) -> bool:
        return bool(PER_EXPERT_KEY.match(key)) or any(re.search(old, key) for old in OLDER_SEGMENTATION_KEYS)

    def renamed(key: str) -> str:
        for old, new in OLDER_SEGMENTATION_KEYS.items():
            key = re.sub(old, new, key)
        return key

    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        return False
    with safe_open(str(path), "pt") as f:
        if not any(older(key) for key in f.keys()):
            return False
        metadata = f.metadata()
    fused = fuse_per_expert_state_dict(load_file(str(path)))
    staged = path.with_name(path.name + ".converting")
    save_file({renamed(key): value for key, value in fused.items()}, str(staged), metadata=metadata)
    os.replace(staged, path)
    return True
