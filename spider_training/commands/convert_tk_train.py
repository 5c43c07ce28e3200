"""Import a checkpoint of tk-train.py (``spider-stepN.pt``) as a safetensors release -- the only way its pickle gets
in.

``python -m spider_training.commands.convert_tk_train spider-step50.pt OUTPUT_DIR [--preset NAME] [--dtype
checkpoint|float32|...]
[--rename PATTERN=REPLACEMENT ...] [--overwrite] [--strict]`` prints a JSON report on stdout and writes ``OUTPUT_DIR``
with
``SpiderForConditionalGeneration.save_pretrained`` (``model.safetensors``, ``config.json`` with ``auto_map``, the
module files) plus the ``SpiderTokenizer`` files and ``tk_train_conversion.json`` (the same report), so that
``AutoModelForCausalLM.from_pretrained(OUTPUT_DIR, trust_remote_code=True)`` loads it. Everything else in Spider
writes and reads safetensors only.

What a tk-train.py checkpoint is (``tk-train.py``, the original training script, ``save_step_checkpoint`` and the final
save): ``torch.save`` of
``{"step", "epoch", "model_state_dict", "optimizer_state_dict", "cfg", "best_loss"}``, where ``model_state_dict`` is
``model.state_dict()`` of the *wrapped* training model (``torch.compile`` adds ``_orig_mod.``, DDP adds ``module.``;
torchao's ``Float8Linear`` keeps ``nn.Linear``'s ``weight``/``bias`` names), usually in bf16 (tk-train.py runs
``model.to(bf16)``), and ``cfg`` is a ``SpiderConfig()`` instance of tk-train.py's model file. ``tk-train.py`` loads
that
file with ``importlib.import_module("tk-spider")``, so the pickle names the class ``tk-spider.SpiderConfig``
(``fp8-ready-spider.SpiderConfig`` for ``fp8_train.py``; ``__main__.SpiderConfig`` if the class was defined in the
script that saved). tk-train.py's model file is not public, so its exact parameter and config field names
are not known: :data:`TK_TRAIN_KEY_MAPPING` and :data:`TK_TRAIN_CFG_ALIASES` hold the documented guesses, every key
that does not
map is reported, and ``--rename`` adds rules without editing code.

Safety: the file is read with ``torch.load(..., weights_only=True)`` (torch's restricted unpickler: tensors,
containers, numbers, strings, dtypes). tk-train.py's config class is never imported: each name in
:data:`TK_TRAIN_CFG_GLOBALS` is allowlisted (``torch.serialization.safe_globals``) as an inert stand-in,
:class:`TkTrainConfigData`, that only stores the pickled ``__dict__``. Any other global (``os.system`` in a
``__reduce__``, a class not on the list) makes the load fail before anything runs, and the conversion raises
:class:`UnsafeCheckpointError` naming the file and the offending globals.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pickle
import re
import sys
import zipfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------------
# Reading the pickle safely
# --------------------------------------------------------------------------------------------------------------------

#: Pickle globals that name tk-train.py's config class. Each is read through :class:`TkTrainConfigData` (never
#: imported).
#: ``tk-spider``: ``tk-train.py`` line 55 (``importlib.import_module("tk-spider")``); ``fp8-ready-spider``: the model
#: file of ``fp8_train.py`` (the original release's ``hub-README.md``); ``__main__``: a config class defined in the
#: saving script.
TK_TRAIN_CFG_GLOBALS: tuple[str, ...] = (
    "tk-spider.SpiderConfig",
    "fp8-ready-spider.SpiderConfig",
    "__main__.SpiderConfig",
)


class UnsafeCheckpointError(ValueError):
    """The checkpoint's pickle needs a global (function or class) that is not on the weights-only allowlist."""


class TkTrainConfigData:
    """Inert stand-in for tk-train.py's pickled config object: holds its state as plain data, runs none of its code.

    torch's weights-only unpickler creates it for an allowlisted global (``NEWOBJ`` -> ``__new__``, or ``REDUCE`` ->
    ``__init__`` with the pickled arguments) and hands it the object's state (``BUILD`` -> :meth:`__setstate__`). The
    state arrives already unpickled by the restricted unpickler, so it holds only allowlisted types.

    Attributes:
        fields (`dict[str, Any]`): the pickled ``__dict__`` (plus ``__slots__`` state, if any).
        args (`tuple`): constructor arguments the pickle carried (normally empty).
        pickle_global (`str`): the pickle global this instance stood in for, e.g. ``"tk-spider.SpiderConfig"``.
    """

    pickle_global = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = tuple(args)
        obj.fields = dict(kwargs)
        return obj

    def __init__(self, *args, **kwargs):  # REDUCE path: arguments were stored by __new__, nothing to run
        pass

    def __setstate__(self, state):
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if not isinstance(part, dict):
                raise pickle.UnpicklingError(
                    f"{self.pickle_global}: expected the pickled state to be a dict, got {type(part).__name__}"
                )
            self.fields.update({str(k): v for k, v in part.items()})

    def __repr__(self) -> str:
        return f"TkTrainConfigData({self.pickle_global}, {len(self.fields)} fields)"


#: one :class:`TkTrainConfigData` subclass per name in :data:`TK_TRAIN_CFG_GLOBALS`, as ``safe_globals`` entries
_STAND_INS = [
    (type("TkTrainConfigData", (TkTrainConfigData,), {"pickle_global": name, "__module__": __name__}), name)
    for name in TK_TRAIN_CFG_GLOBALS
]


def _sniff_format(path: Path) -> str:
    """``"zip"`` (``torch.save`` default) or ``"legacy"`` (a raw pickle stream). Raises for anything else."""
    if not path.exists():
        raise FileNotFoundError(f"tk-train.py checkpoint {path} does not exist")
    if not path.is_file():
        raise ValueError(f"tk-train.py checkpoint {path} is not a file")
    with open(path, "rb") as handle:
        head = handle.read(4)
    if not head:
        raise ValueError(f"tk-train.py checkpoint {path} is empty")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile as err:
            raise ValueError(f"tk-train.py checkpoint {path} is a damaged zip archive: {err}") from err
        if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
            raise ValueError(f"tk-train.py checkpoint {path} is a TorchScript archive, not a torch.save checkpoint")
        if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            raise ValueError(
                f"tk-train.py checkpoint {path} is a zip archive without data.pkl: not a torch.save checkpoint"
            )
        return "zip"
    if head[:1] == b"\x80":  # pickle PROTO opcode: torch's legacy (pre-1.6) format starts with a pickled magic number
        return "legacy"
    raise ValueError(
        f"tk-train.py checkpoint {path} is not a torch checkpoint: neither a torch.save zip archive nor "
        f"a pickle (first bytes {head!r})"
    )


def _offending_globals(message: str) -> list[str]:
    found = re.findall(r"GLOBAL ([^\s]+)", message)
    found += re.findall(r"unrecognized function ([^\s]+(?: which belongs to [^\s]+)?)", message)
    found += re.findall(r"(?:new object for|but got) <class '([^']+)'>", message)
    return list(dict.fromkeys(found))


def load_tk_train_checkpoint(path: str | os.PathLike) -> dict:
    """Read a tk-train.py checkpoint with torch's weights-only unpickler; tk-train.py's config becomes
    :class:`TkTrainConfigData`.

    Args:
        path: a ``spider-stepN.pt`` file (``torch.save`` zip format, or the legacy pickle format).
    Returns:
        The checkpoint dict, tensors on CPU (memory-mapped for the zip format).
    Raises:
        FileNotFoundError: no such file.
        UnsafeCheckpointError (a ``ValueError``): the pickle names a global outside the allowlist (the message names
            the file and the globals); nothing from it was called.
        ValueError: not a file, empty, not a zip/pickle, damaged, or the top level is not a dict.
    """
    path = Path(path)
    kind = _sniff_format(path)
    with torch.serialization.safe_globals(_STAND_INS):
        if kind == "zip":
            try:
                unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
            except Exception as err:  # a damaged archive: report it as such rather than as unsafe
                raise ValueError(
                    f"tk-train.py checkpoint {path} could not be read as a torch.save archive: {err}"
                ) from err
            if unsafe:
                raise UnsafeCheckpointError(
                    f"refusing to load tk-train.py checkpoint {path}: its pickle needs {unsafe}, which "
                    f"{'is' if len(unsafe) == 1 else 'are'} not on the weights-only allowlist (tensors, containers, "
                    f"numbers, strings, dtypes, and tk-train.py's config class as inert data: "
                    f"{list(TK_TRAIN_CFG_GLOBALS)}). "
                    "Loading it would import or run code from the file."
                )
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=kind == "zip")
        except pickle.UnpicklingError as err:
            offending = _offending_globals(str(err))
            detail = (
                f"{offending}, which {'is' if len(offending) == 1 else 'are'} not on the allowlist"
                if offending
                else "an object it may not build"
            )
            raise UnsafeCheckpointError(
                f"refusing to load tk-train.py checkpoint {path}: the weights-only unpickler stopped at {detail} "
                f"(allowed: tensors, containers, numbers, strings, dtypes, and tk-train.py's config class as inert "
                f"data: "
                f"{list(TK_TRAIN_CFG_GLOBALS)}). Nothing from the file was run."
            ) from err
        except (RuntimeError, EOFError, OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"tk-train.py checkpoint {path} could not be read: {type(err).__name__}: {err}") from err
    if not isinstance(checkpoint, dict):
        raise ValueError(
            f"tk-train.py checkpoint {path} holds a {type(checkpoint).__name__}, expected tk-train.py's "
            "dict with keys model_state_dict, optimizer_state_dict, step, epoch, cfg, best_loss"
        )
    return checkpoint


# --------------------------------------------------------------------------------------------------------------------
# Parameter names: tk-train.py -> Spider
# --------------------------------------------------------------------------------------------------------------------

#: tk-train.py state-dict key -> Spider key, as regular expressions applied in order with ``re.sub`` (the format of
#: transformers' ``from_pretrained(key_mapping=...)``); a key no pattern changes is taken as is (tk-train.py used
#: transformers-style names: its FP8 filter selects ``embed_tokens, lm_head, layernorm, norm, router,
#: boundary_predictor, loop_embedding, halt_predictor, engram``). The first two drop wrapper names: DDP (``module.``)
#: and ``torch.compile`` (``_orig_mod.``), which ``tk-train.py`` applies before ``model.state_dict()`` is saved, and
#: FSDP / activation-checkpoint wrappers anywhere in a key. The others are where tk-train.py's forward pass names a
#: piece and Spider's modules hold it (``model.`` optional: a trunk saved without the base-model prefix).
TK_TRAIN_KEY_MAPPING: dict[str, str] = {
    r"^(?:module\.|_orig_mod\.)+": "",
    r"(?:_fsdp_wrapped_module|_checkpoint_wrapped_module)\.": "",
    r"^(?:model\.)?prelude\.(\d+)\.": r"model.prelude_layers.\1.",  # `x = prelude(x)`
    r"^(?:model\.)?recurrent_layers\.(\d+)\.": r"model.recurrent_block.layers.\1.",  # `for layer in recurrent_layers`
    r"^(?:model\.)?coda\.(\d+)\.": r"model.coda_layers.\1.",  # `y = coda(y)`
    # the boundary predictor as nn.Sequential(Linear(D, D), GELU, Linear(D, 1)) (FlexiTokens / Nawrot et al.)
    r"^(?:model\.)?boundary_predictor\.0\.": "model.flexitokens.boundary_predictor.dense.",
    r"^(?:model\.)?boundary_predictor\.2\.": "model.flexitokens.boundary_predictor.out_proj.",
    # tk-train.py names the loop machinery and the segmentation at model level (segmentation parameters in its own
    # words, docs/design.md "Glossary"); Spider holds them in two modules
    r"^(?:model\.)?(loop_embedding|loop_norm|loop_lora|injection|halt_predictor)\.": r"model.recurrent_block.\1.",
    r"^(?:model\.)?(boundary_predictor\.|residual_proj\.)": r"model.flexitokens.\1",
    r"^(?:model\.)?null_group$": "model.flexitokens.null_segment",
    r"^(?:model\.)?down_norm\.": "model.flexitokens.pool_norm.",
    r"^(?:model\.)?upsample_norm\.": "model.flexitokens.expand_norm.",
}
#: how many leading entries of :data:`TK_TRAIN_KEY_MAPPING` only remove wrapper names (counted, not listed, as renames)
_WRAPPER_PATTERNS = 2


def parse_key_mapping(spec: str) -> tuple[str, str]:
    """``"PATTERN=REPLACEMENT"`` (``--rename``) -> ``(pattern, replacement)``: a regular expression and its ``re.sub``
    replacement (``\\1`` for groups), e.g. ``"^model\\.halt\\.=model.recurrent_block.halt_predictor."``.

    Raises:
        ValueError: no ``=``, an empty pattern, or a pattern that does not compile (the message names the rule).
    """
    pattern, sep, replacement = spec.partition("=")
    if not sep or not pattern.strip():
        raise ValueError(f"rename rule {spec!r} must have the form PATTERN=REPLACEMENT (a regular expression)")
    try:
        re.compile(pattern.strip())
    except re.error as err:
        raise ValueError(f"rename rule {spec!r}: the pattern is not a regular expression: {err}") from None
    return pattern.strip(), replacement.strip()


def tk_train_to_spider_name(name: str, key_mapping: dict[str, str] | None = None) -> str:
    """The Spider state-dict key a checkpoint key maps to: :data:`TK_TRAIN_KEY_MAPPING`, then `key_mapping`, in
    order."""
    for pattern, replacement in {**TK_TRAIN_KEY_MAPPING, **(key_mapping or {})}.items():
        name = re.sub(pattern, replacement, name)
    return name


def _fuse_per_expert_weights(
    checkpoint_state: dict, targets: dict[str, str], model_state: dict
) -> tuple[dict, dict[str, str], dict[str, list[str]]]:
    """tk-train.py's routed experts are one ``nn.Linear`` SwiGLU each (``...mlp.experts.{e}.gate_proj.weight`` etc., as
    Spider's were before the experts were fused); Spider's are fused (``...mlp.experts.gate_up_proj`` / ``down_proj``).

    Returns ``(state, targets, sources)``: `checkpoint_state` and `targets` (checkpoint key -> Spider key) with every
    complete
    per-expert group whose fused names the model has replaced by the two fused tensors
    (``spider_training.checkpointing.fuse_per_expert_state_dict``) under entry names ``"fused:<spider key>"``;
    ``sources`` maps
    each such entry to the checkpoint keys it was built from. Incomplete groups and groups the model has no fused names
    for
    are left as they are (reported as unmapped downstream)."""
    from spider_training.checkpointing import PER_EXPERT_KEY, fuse_per_expert_state_dict

    groups: dict[str, list[str]] = {}
    for checkpoint_key, target in targets.items():
        match = PER_EXPERT_KEY.match(target)
        if (
            match
            and isinstance(checkpoint_state[checkpoint_key], torch.Tensor)
            and match["prefix"] + "gate_up_proj" in model_state
        ):
            groups.setdefault(match["prefix"], []).append(checkpoint_key)
    state, targets, sources = dict(checkpoint_state), dict(targets), {}
    for prefix, checkpoint_keys in groups.items():
        try:
            fused = fuse_per_expert_state_dict({targets[k]: checkpoint_state[k] for k in checkpoint_keys})
        except ValueError:  # an incomplete group: its keys stay as they are, unmapped
            continue
        for key in checkpoint_keys:
            del state[key]
        for name, tensor in fused.items():
            is_down = name.endswith("down_proj")
            entry = f"fused:{name}"
            state[entry], targets[entry] = tensor, name
            sources[entry] = [
                k for k in checkpoint_keys if (PER_EXPERT_KEY.match(targets[k])["proj"] == "down_proj") == is_down
            ]
    return state, targets, sources


def map_state_dict(
    checkpoint_state: dict, model_state: dict, key_mapping: dict[str, str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Match checkpoint tensors to the Spider model's state dict by name (:func:`tk_train_to_spider_name`) and shape;
    tk-train.py's
    per-expert routed-expert weights are fused into Spider's ``gate_up_proj`` / ``down_proj`` first
    (:func:`_fuse_per_expert_weights`), and each of them is reported as renamed to its fused key.

    Args:
        checkpoint_state: tk-train.py's ``model_state_dict`` (names as saved, wrappers included).
        model_state: ``model.state_dict()`` of the target Spider model (only names and shapes are read).
        key_mapping: additional ``{pattern: replacement}`` renames.
    Returns:
        ``(mapped, details)``: ``mapped`` is ``{spider_key: checkpoint_tensor}`` for every name *and* shape match (the
        first checkpoint key wins); ``details`` has ``unwrapped`` (how many mapped keys carried wrapper names),
        ``renamed``
        (``{checkpoint_key: spider_key}`` where the names differ beyond those wrappers), ``unmapped_checkpoint_keys``
        (no
        Spider counterpart, or not a tensor), ``duplicate_checkpoint_keys``, ``shape_mismatches`` (``[{checkpoint_key,
        model_key, checkpoint_shape, model_shape}]``) and ``missing_model_keys`` (Spider keys that received nothing:
        they
        keep their fresh initialisation; this includes the targets of shape mismatches).
    """
    wrappers = dict(list(TK_TRAIN_KEY_MAPPING.items())[:_WRAPPER_PATTERNS])
    mapped: dict[str, torch.Tensor] = {}
    renamed, unmapped, duplicates, mismatches, wrapped = {}, [], [], [], 0
    targets = {}
    for checkpoint_key in checkpoint_state:
        target = tk_train_to_spider_name(checkpoint_key, key_mapping)
        if f"model.{target}" in model_state and target not in model_state:
            target = f"model.{target}"  # a tk-train.py trunk saved without the `model.` base-model prefix
        targets[checkpoint_key] = target
    checkpoint_state, targets, sources = _fuse_per_expert_weights(checkpoint_state, targets, model_state)
    for entry, value in checkpoint_state.items():
        target, originals = targets[entry], sources.get(entry, [entry])
        if not isinstance(value, torch.Tensor) or target not in model_state:
            unmapped.extend(originals)
        elif target in mapped:
            duplicates.extend(originals)
        elif tuple(value.shape) != tuple(model_state[target].shape):
            mismatches.append(
                {
                    "checkpoint_key": "+".join(originals),
                    "model_key": target,
                    "checkpoint_shape": list(value.shape),
                    "model_shape": list(model_state[target].shape),
                }
            )
        else:
            mapped[target] = value
            for checkpoint_key in originals:
                unwrapped = checkpoint_key
                for pattern, replacement in wrappers.items():
                    unwrapped = re.sub(pattern, replacement, unwrapped)
                wrapped += unwrapped != checkpoint_key
                if target != unwrapped:
                    renamed[checkpoint_key] = target
    details = {
        "unwrapped": wrapped,
        "renamed": renamed,
        "unmapped_checkpoint_keys": unmapped,
        "duplicate_checkpoint_keys": duplicates,
        "shape_mismatches": mismatches,
        "missing_model_keys": [k for k in model_state if k not in mapped],
    }
    return mapped, details


# --------------------------------------------------------------------------------------------------------------------
# Config: checkpoint cfg fields -> SpiderConfig
# --------------------------------------------------------------------------------------------------------------------

#: tk-train.py config field names that differ from SpiderConfig's, with where the name comes from: OpenMythos'
#: MythosConfig
#: (the recurrent-depth design tk-train.py follows: ``dim, n_heads, max_seq_len, prelude_layers, coda_layers,
#: n_experts,
#: n_experts_per_tok, expert_dim``) and common transformers spellings. A field that *is* a SpiderConfig field is
#: taken under its own name; an exact name wins over an alias.
TK_TRAIN_CFG_ALIASES: dict[str, str] = {
    "lora_rank": "loop_adapter_rank",
    "dim": "hidden_size",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "num_heads": "num_attention_heads",
    "max_seq_len": "max_position_embeddings",
    "prelude_layers": "num_prelude_layers",
    "n_prelude_layers": "num_prelude_layers",
    "recurrent_layers": "num_recurrent_layers",
    "n_recurrent_layers": "num_recurrent_layers",
    "coda_layers": "num_coda_layers",
    "n_coda_layers": "num_coda_layers",
    "n_experts": "n_routed_experts",
    "num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "n_experts_per_tok": "num_experts_per_tok",
    "top_k": "num_experts_per_tok",
    "expert_dim": "moe_intermediate_size",
    "engram_layers": "engram_layer_ids",
    "norm_eps": "rms_norm_eps",
}

#: SpiderConfig fields a checkpoint value must not set: ``num_hidden_layers`` is derived (prelude + recurrent + coda).
_DERIVED_FIELDS = {"num_hidden_layers": "derived by SpiderConfig (prelude + recurrent + coda)"}


def _spider_fields() -> set[str]:
    from configuration_spider import SpiderConfig

    return set(SpiderConfig.__annotations__)  # the fields SpiderConfig itself declares (not PreTrainedConfig's)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _jsonable(value.item())
    return repr(value)


def tk_train_cfg_fields(cfg: Any, source: str = "tk-train.py checkpoint") -> tuple[dict[str, Any] | None, str | None]:
    """``(fields, global_name)`` of the checkpoint's ``cfg`` entry: a :class:`TkTrainConfigData`, a plain dict, or
    None.

    Raises:
        ValueError: ``cfg`` is some other type (the message names `source`).
    """
    if cfg is None:
        return None, None
    if isinstance(cfg, TkTrainConfigData):
        return dict(cfg.fields), cfg.pickle_global
    if isinstance(cfg, dict):
        return {str(k): v for k, v in cfg.items()}, None
    raise ValueError(f"{source}: cfg is a {type(cfg).__name__}; expected tk-train.py's config object, a dict, or None")


def build_config(fields: dict[str, Any] | None, preset: str | None = None, source: str = "tk-train.py checkpoint"):
    """Build a :class:`SpiderConfig` from tk-train.py's config fields on top of `preset` (default: ``SpiderConfig()``).

    Returns:
        ``(config, used, ignored)``: ``used`` maps checkpoint field -> SpiderConfig field; ``ignored`` maps checkpoint
        field ->
        reason (no counterpart, derived, shadowed by the exact name).
    Raises:
        ValueError: unknown preset, or checkpoint values that SpiderConfig rejects (the message names `source`).
    """
    from configuration_spider import SpiderConfig

    known = _spider_fields()
    used: dict[str, str] = {}
    ignored: dict[str, str] = {}
    overrides: dict[str, Any] = {}
    for name, value in (fields or {}).items():
        if name in _DERIVED_FIELDS:
            ignored[name] = _DERIVED_FIELDS[name]
        elif name in known:
            used[name], overrides[name] = name, value
    for name, value in (fields or {}).items():
        if name in used or name in ignored:
            continue
        target = TK_TRAIN_CFG_ALIASES.get(name)
        if target is None or target not in known:
            ignored[name] = "no SpiderConfig counterpart"
        elif target in overrides:
            ignored[name] = f"alias of {target}, which the checkpoint cfg also sets under that name"
        else:
            used[name], overrides[target] = target, value
    overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}
    try:
        config = SpiderConfig.from_preset(preset, **overrides) if preset else SpiderConfig(**overrides)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{source}: the checkpoint cfg does not give a valid SpiderConfig "
            f"(preset {preset or 'default'}; checkpoint fields {used}): {err}"
        ) from err
    return config, used, ignored


# --------------------------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Deprecated values of ``dtype`` / ``--dtype`` -> their current name; accepted with a warning (logged once).
DEPRECATED_DTYPES = {"seed": "checkpoint"}
_warned_dtypes: set[str] = set()


def _checkpoint_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    counts = Counter(t.dtype for t in tensors if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.float32


def convert_tk_train_checkpoint(
    path: str | os.PathLike,
    output_dir: str | os.PathLike,
    preset: str | None = None,
    *,
    dtype: str | None = None,
    renames: Iterable[str] = (),
    overwrite: bool = False,
    strict: bool = False,
) -> dict:
    """Convert a tk-train.py ``spider-stepN.pt`` into a safetensors release folder and return the report.

    Args:
        path: the tk-train.py checkpoint (see the module docstring for its layout).
        output_dir: the release folder to write (created; written to a temp sibling and renamed into place).
        preset: SpiderConfig preset tk-train.py's cfg fields are applied on top of (``"tiny"``, ``"small"``, ``"1b"``);
            default ``SpiderConfig()`` (tk-train.py's ~1B model). Fields the checkpoint cfg lacks come from here.
        dtype: weights dtype of the release: ``None``/``"checkpoint"`` keeps the checkpoint's (its most common float
        dtype,
            usually bf16), or ``"float32"``, ``"bfloat16"``, ``"float16"``.
        renames: extra ``PATTERN=REPLACEMENT`` rules (see :func:`parse_key_mapping`), applied after
            :data:`TK_TRAIN_KEY_MAPPING`.
        overwrite: replace a non-empty `output_dir` (default: refuse).
        strict: refuse (``ValueError``, nothing written) unless every checkpoint tensor maps and every model key is
        filled.
    Returns:
        A JSON-serialisable dict: ``checkpoint, output_dir, format, cfg_global, step, epoch, best_loss, preset,
        dtype, mapped`` (count), ``model_keys`` (count), ``unwrapped, renamed, unmapped_checkpoint_keys,
        duplicate_checkpoint_keys, shape_mismatches,
        missing_model_keys, cfg_fields_used, cfg_fields_ignored, complete, files``. Model keys that receive no
        checkpoint
        tensor keep a fresh initialisation (seeded, reproducible) and are listed in ``missing_model_keys``.
    Raises:
        FileNotFoundError: `path` does not exist.
        UnsafeCheckpointError (``ValueError``): the pickle needs a non-allowlisted global (nothing from it ran).
        ValueError: not a torch checkpoint, no ``model_state_dict``, invalid cfg values, bad dtype / rename / preset,
            `strict` and the mapping is incomplete.
        FileExistsError: `output_dir` exists, is not empty, and `overwrite` is False.
    """
    from configuration_spider import SPIDER_PRESETS
    from modeling_spider import SpiderForConditionalGeneration
    from tokenization_spider import SpiderTokenizer

    from ..checkpointing import save_folder_atomically

    path, output_dir = Path(path), Path(output_dir)
    if preset is not None and preset not in SPIDER_PRESETS:
        raise ValueError(f"unknown Spider preset {preset!r}; known presets: {sorted(SPIDER_PRESETS)}")
    if dtype in DEPRECATED_DTYPES:
        if dtype not in _warned_dtypes:  # once per name
            logger.warning("dtype %r is deprecated; use %r (the same)", dtype, DEPRECATED_DTYPES[dtype])
        _warned_dtypes.add(dtype)
        dtype = DEPRECATED_DTYPES[dtype]
    if dtype not in (None, "checkpoint", *DTYPES):
        raise ValueError(f"dtype {dtype!r} is not one of {['checkpoint', *DTYPES]}")
    key_mapping = dict(parse_key_mapping(spec) for spec in renames)
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())) and not overwrite:
        raise FileExistsError(f"output folder {output_dir} exists and is not empty; pass overwrite=True (--overwrite)")

    checkpoint = load_tk_train_checkpoint(path)
    if "model_state_dict" not in checkpoint:
        raise ValueError(
            f"tk-train.py checkpoint {path} has no 'model_state_dict' (keys: {sorted(map(str, checkpoint))});"
            " such a checkpoint holds model_state_dict, optimizer_state_dict, step, epoch, cfg, best_loss"
        )
    checkpoint_state = checkpoint["model_state_dict"]
    if not isinstance(checkpoint_state, dict):
        raise ValueError(
            f"tk-train.py checkpoint {path}: model_state_dict is a {type(checkpoint_state).__name__}, expected a dict"
        )
    fields, cfg_global = tk_train_cfg_fields(checkpoint.get("cfg"), source=f"tk-train.py checkpoint {path}")
    config, cfg_used, cfg_ignored = build_config(fields, preset, source=f"tk-train.py checkpoint {path}")

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # missing keys get a reproducible fresh initialisation
        model = SpiderForConditionalGeneration(config)
    mapped, details = map_state_dict(checkpoint_state, model.state_dict(), key_mapping)
    target_dtype = _checkpoint_dtype(mapped.values()) if dtype in (None, "checkpoint") else DTYPES[dtype]
    complete = not (
        details["unmapped_checkpoint_keys"]
        or details["shape_mismatches"]
        or details["missing_model_keys"]
        or details["duplicate_checkpoint_keys"]
    )
    if strict and not complete:
        raise ValueError(
            f"tk-train.py checkpoint {path} does not map completely (strict): "
            f"{len(details['unmapped_checkpoint_keys'])} unmapped checkpoint keys "
            f"{details['unmapped_checkpoint_keys'][:5]}, {len(details['shape_mismatches'])} shape mismatches, "
            f"{len(details['missing_model_keys'])} missing model keys {details['missing_model_keys'][:5]}"
        )
    model = model.to(target_dtype)
    result = model.load_state_dict(mapped, strict=False)
    if result.unexpected_keys:  # cannot happen: mapped keys are drawn from the model's own state dict
        raise RuntimeError(f"internal error: unexpected keys {result.unexpected_keys}")
    model.eval()

    report = {
        "checkpoint": str(path),
        "output_dir": str(output_dir),
        "cfg_global": cfg_global,
        **{key: _jsonable(checkpoint.get(key)) for key in ("step", "epoch", "best_loss")},
        "preset": preset,
        "dtype": str(target_dtype).removeprefix("torch."),
        "mapped": len(mapped),
        "model_keys": len(model.state_dict()),
        **details,
        "cfg_fields_used": cfg_used,
        "cfg_fields_ignored": cfg_ignored,
        "complete": complete,
    }

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        SpiderTokenizer().save_pretrained(folder)
        report["files"] = sorted(os.listdir(folder)) + ["tk_train_conversion.json"]
        (folder / "tk_train_conversion.json").write_text(json.dumps(report, indent=2) + "\n")

    save_folder_atomically(output_dir, write)
    return report


def build_parser() -> argparse.ArgumentParser:
    from configuration_spider import SPIDER_PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m spider_training.commands.convert_tk_train",
        description="Convert a tk-train.py checkpoint (spider-stepN.pt, a torch pickle) into a safetensors release "
        "folder. "
        "The pickle is read with torch's weights-only unpickler; tk-train.py's config class is read as inert data.",
    )
    parser.add_argument("checkpoint", help="tk-train.py checkpoint file, e.g. checkpoints-tk/spider-step50.pt")
    parser.add_argument("output_dir", help="release folder to write")
    parser.add_argument(
        "--preset",
        choices=sorted(SPIDER_PRESETS),
        default=None,
        help="SpiderConfig preset under tk-train.py's cfg fields (default: SpiderConfig(), the 1B model)",
    )
    parser.add_argument(
        "--dtype",
        choices=["checkpoint", *DTYPES, *DEPRECATED_DTYPES],
        default="checkpoint",
        help="weights dtype of the release (default: keep the checkpoint's; 'seed' is the deprecated name of "
        "'checkpoint')",
    )
    parser.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="PATTERN=REPLACEMENT",
        help="extra key rule, a regular expression and its re.sub replacement, e.g. "
        "'^model\\.halt\\.=model.recurrent_block.halt_predictor.'; repeatable",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT_DIR")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="write nothing unless every checkpoint tensor maps and every model key is filled",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints the JSON report on stdout; errors go to stderr with exit status 1."""
    args = build_parser().parse_args(argv)
    try:
        report = convert_tk_train_checkpoint(
            args.checkpoint,
            args.output_dir,
            args.preset,
            dtype=args.dtype,
            renames=args.rename,
            overwrite=args.overwrite,
            strict=args.strict,
        )
    except (OSError, ValueError) as err:
        print(f"convert_tk_train: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    if not report["complete"]:
        print(
            f"convert_tk_train: warning: incomplete mapping: {len(report['unmapped_checkpoint_keys'])} unmapped "
            "checkpoint keys, "
            f"{len(report['shape_mismatches'])} shape mismatches, {len(report['missing_model_keys'])} model keys "
            "left at fresh initialisation (see the report)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
