"""Write the release folder's ``README.md`` model card and ``loss_curve.png`` for a Spider training run.

:func:`write_model_card` fills the Jinja template ``hub_card/model_card.md.j2`` (edit the wording there, no Python
needed) through ``huggingface_hub.ModelCard.from_template`` with a ``ModelCardData`` front matter (language, license,
``library_name: transformers``, ``pipeline_tag: text-generation``, tags, Hub datasets, and a ``model-index`` entry with
the held-out bits per byte when it is known), and draws the loss curve from ``Trainer.state.log_history`` with
matplotlib's Agg backend (an ``matplotlib.figure.Figure``, no pyplot global state: safe in any thread).

The card's "What trust_remote_code=True runs" section is computed, not asserted: it lists the three remote-code files
found in the release folder (``configuration_spider.py``, ``modeling_spider.py``, ``tokenization_spider.py``) with their
sha256 and the modules they import (parsed with ``ast``; standard library told apart with
``sys.stdlib_module_names``).

Recognised keys of the input dicts (all optional; unrecognised keys are shown too, under their own name; ``None``
values are left out):

* ``config``: ``SpiderConfig.to_dict()`` (the full dict: ``to_diff_dict()`` leaves out every field equal to the
  1B defaults, and the card then shows ``?`` for it) -- architecture fields (``hidden_size``, ``num_*_layers``,
  ``n_routed_experts``, ``num_experts_per_tok``, ``n_loops``, ...) go into the configuration table, the whole dict
  into a collapsed JSON block.
* ``training``: ``precision`` (``"fp8"`` adds the ``fp8`` tag and the FP8 paragraph), ``optimizer``,
  ``learning_rate``, ``lr_scheduler``, ``warmup_steps``, ``max_steps``, ``global_step``, ``per_device_batch_size``,
  ``gradient_accumulation_steps``, ``world_size``, ``seq_len``, ``train_tokens``, ``num_parameters``, ``n_loops``,
  ``train_runtime_s``, ``hardware``, ``seed``, ``experts_implementation`` (``moe_implementation`` in records from
  before the experts were fused).
* ``data``: ``source``, ``name``, ``hub_dataset`` (a Hub dataset id, or a list: goes into the ``datasets`` metadata),
  ``train_bytes``, ``eval_bytes``, ``eval_split`` (how the held-out split was made), ``num_documents``,
  ``description``.
* ``metrics``: ``bits_per_byte_before``, ``bits_per_byte_after`` (held-out, before/after training; also read as
  ``eval_before_bits_per_byte`` / ``eval_after_bits_per_byte``, the names ``Trainer.evaluate(metric_key_prefix=
  "eval_before")`` produces), ``final_train_loss``, ``final_eval_loss``, ``train_loss``, ``tokens_per_second``,
  ``train_runtime_s``, ``parameters``.

``spider_training/release.py``'s names are recognised too: ``training`` ``steps``, ``micro_batch``, ``grad_accum``,
``moe_backend``; ``data`` ``eval``. The parameter count is read from ``training["num_parameters"]`` or
``metrics["parameters"]``.

Keys ending in ``_bytes`` are shown with a MiB figure, ``_s`` as seconds.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

_CHECKOUT_TEMPLATE = Path(__file__).resolve().parent.parent / "hub_card" / "model_card.md.j2"
_INSTALLED_TEMPLATE = Path(__file__).resolve().parent / "hub_card" / "model_card.md.j2"  # package data of a wheel
#: the card template: ``hub_card/`` of a source checkout, else the copy an installed wheel carries
DEFAULT_TEMPLATE = _CHECKOUT_TEMPLATE if _CHECKOUT_TEMPLATE.is_file() else _INSTALLED_TEMPLATE
#: Loss-curve file name inside the release folder (the card links to it relatively).
LOSS_CURVE_NAME = "loss_curve.png"
#: Tags every Spider card carries; ``fp8`` is added when the run's precision was FP8.
BASE_TAGS = ["spider", "byte-level", "moe", "recurrent-depth", "flexitokens", "mla", "engram", "custom_code"]

REMOTE_CODE_FILES = {
    "configuration_spider.py": "`SpiderConfig` (all hyper-parameters)",
    "modeling_spider.py": "the network: `SpiderModel`, `SpiderForConditionalGeneration`",
    "tokenization_spider.py": "`SpiderTokenizer` (bytes <-> ids, no vocabulary file)",
}
#: Modules that can reach the network or run programs; flagged in the card if remote code imports them.
RISKY_MODULES = {
    "socket", "ssl", "urllib", "http", "ftplib", "smtplib", "telnetlib", "xmlrpc", "subprocess", "multiprocessing",
    "requests", "httpx", "httpx2", "aiohttp", "urllib3", "ctypes", "webbrowser",
}

CONFIG_LABELS = {
    "hidden_size": "hidden size",
    "num_prelude_layers": "prelude layers (dense, bytes)",
    "num_recurrent_layers": "recurrent layers (MLA + MoE, segments)",
    "num_coda_layers": "coda layers (dense, bytes)",
    "num_attention_heads": "attention heads",
    "q_lora_rank": "MLA query rank",
    "kv_lora_rank": "MLA key/value rank",
    "n_routed_experts": "routed experts per layer",
    "num_experts_per_tok": "experts per token (top-k)",
    "n_shared_experts": "shared experts",
    "moe_intermediate_size": "expert width",
    "intermediate_size": "dense feed-forward width",
    "engram_layer_ids": "Engram memory at recurrent layers",
    "engram_ngram_sizes": "Engram n-gram orders",
    "n_loops": "default loops (`n_loops`)",
    "max_loop_iters": "loop embeddings (`max_loop_iters`)",
    "act_threshold": "ACT halting threshold",
    "lora_rank": "per-loop LoRA rank",
    "boundary_prior": "target boundaries per byte",
    "boundary_teacher": "boundary teacher",
    "vocab_size": "vocabulary",
    "max_position_embeddings": "max positions (bytes)",
    "moe_implementation": "expert compute path",  # config.json of releases before the experts were fused
}
TRAINING_LABELS = {
    "precision": "precision",
    "optimizer": "optimizer",
    "learning_rate": "peak learning rate",
    "lr_scheduler": "schedule",
    "warmup_steps": "warm-up steps",
    "max_steps": "planned steps",
    "global_step": "steps done",
    "per_device_batch_size": "sequences per device per step",
    "gradient_accumulation_steps": "gradient accumulation",
    "world_size": "processes",
    "seq_len": "sequence length (bytes)",
    "train_tokens": "training bytes seen",
    "num_parameters": "parameters",
    "n_loops": "loops during training",
    "train_runtime_s": "wall-clock time",
    "hardware": "hardware",
    "seed": "seed",
    "experts_implementation": "expert compute path",
    "moe_implementation": "expert compute path",  # records from before the experts were fused
    # names used by spider_training/release.py
    "steps": "optimizer steps",
    "micro_batch": "sequences per device per step",
    "grad_accum": "gradient accumulation",
    "moe_backend": "MoE compute backend",
}
DATA_LABELS = {
    "name": "dataset",
    "source": "source",
    "hub_dataset": "Hub dataset",
    "description": "description",
    "num_documents": "documents",
    "train_bytes": "training bytes",
    "eval_bytes": "held-out bytes",
    "eval_split": "held-out split",
    "eval": "held-out split",
}
METRIC_LABELS = {
    "bits_per_byte_before": "held-out bits per byte, before training",
    "bits_per_byte_after": "held-out bits per byte, after training",
    "final_train_loss": "final training loss",
    "final_eval_loss": "final held-out loss (nats/byte)",
    "tokens_per_second": "training throughput (bytes/s)",
    "train_runtime_s": "training time",
    # names used by spider_training/release.py (Trainer.evaluate(metric_key_prefix="eval_before"/"eval_after"))
    "eval_before_bits_per_byte": "held-out bits per byte, before training",
    "eval_after_bits_per_byte": "held-out bits per byte, after training",
    "train_loss": "mean training loss",
    "steps": "optimizer steps",
    "parameters": "parameters",
}
#: Accepted names of the same quantity, first match wins.
BPB_BEFORE_KEYS = ("bits_per_byte_before", "eval_before_bits_per_byte")
BPB_AFTER_KEYS = ("bits_per_byte_after", "eval_after_bits_per_byte", "eval_bits_per_byte")
PARAMETER_KEYS = ("num_parameters", "parameters")
# config.json fields that say nothing about the model itself
_CONFIG_NOISE = {"auto_map", "architectures", "transformers_version", "_name_or_path", "id2label", "label2id"}


# ------------------------------------------------------------------------------------------------ formatting


def _fmt(key: str, value: Any) -> str:
    """Human-readable table cell for ``value`` (``|`` escaped for markdown tables)."""
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int):
        text = f"{value:,}"
        if key.endswith("_bytes"):
            text += f" ({value / 2**20:.1f} MiB)"
        elif key.endswith("_s"):
            text += " s"
    elif isinstance(value, float):
        if not math.isfinite(value):
            text = str(value)
        elif key.endswith("_s"):
            text = f"{value:,.1f} s"
        elif value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            text = f"{value:.3g}"
        elif abs(value) >= 100:
            text = f"{value:,.0f}"
        else:
            text = f"{value:.4g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(_fmt(key, v) for v in value) if value else "none"
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, default=str)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(values: dict, labels: dict[str, str], *, skip: set[str] = frozenset()) -> list[tuple[str, str]]:
    """Table rows: known keys first (in ``labels`` order, with their labels), then the rest under their own name."""
    rows = [(label, _fmt(key, values[key])) for key, label in labels.items() if values.get(key) is not None]
    rows += [
        (f"`{key}`", _fmt(key, value))
        for key, value in values.items()
        if key not in labels and key not in skip and value is not None
    ]
    return rows


def loading_requirements(distribution: str = "spider-lm") -> list[str]:
    """What loading a release needs: the installed `distribution`'s requirements outside its extras, as written in
    its metadata (e.g. ``["torch>=2.8", "transformers>=5.24", ...]``); ``[]`` when it is not installed (a card
    rendered from a bare checkout then says nothing about versions rather than something stale)."""
    from importlib import metadata

    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    return [req for req in requires if "extra ==" not in req]


def _check_dict(name: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"write_model_card: `{name}` must be a dict, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------------------------ remote code


def inspect_remote_code(folder: str | Path) -> tuple[list[dict], dict[str, list[str]]]:
    """Describe the remote-code files of a release folder.

    Returns:
        ``(files, imports)``: ``files`` is one dict per expected file (``name``, ``role``, ``present``, ``sha256``
        hex or ``None``); ``imports`` maps ``"third_party"``, ``"stdlib"``, ``"local"`` (modules of the folder itself,
        e.g. relative imports) and ``"risky"`` (network / process modules) to sorted top-level module names, over
        every ``import`` statement in the present files (function-level ones included).

    Raises:
        SyntaxError: a present file does not parse (message names the file).
    """
    folder = Path(folder)
    files, modules, local = [], set(), set()
    own = {Path(n).stem for n in REMOTE_CODE_FILES}
    for name, role in REMOTE_CODE_FILES.items():
        path = folder / name
        present = path.is_file()
        files.append({"name": name, "role": role, "present": present,
                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if present else None})
        if not present:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as err:
            raise SyntaxError(f"remote-code file {path} does not parse: {err}") from err
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative import: a file of this folder
                    local.add("." + (node.module or ""))
                elif node.module:
                    modules.add(node.module.split(".")[0])
    local = {m.lstrip(".") for m in local} | {m for m in modules if m in own}
    local.discard("")
    modules -= own
    stdlib = {m for m in modules if m in sys.stdlib_module_names or m == "__future__"}
    imports = {
        "third_party": sorted(modules - stdlib),
        "stdlib": sorted(stdlib - {"__future__"}),
        "local": sorted(local),
        "risky": sorted(m for m in modules if m in RISKY_MODULES),
    }
    return files, imports


# ------------------------------------------------------------------------------------------------ loss curve


def _series(history: list[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for i, entry in enumerate(history):
        if not isinstance(entry, dict):
            raise TypeError(f"loss_history[{i}] must be a dict (Trainer.state.log_history entry), got {entry!r}")
        value, step = entry.get(key), entry.get("step")
        if value is None or step is None:
            continue
        try:
            value, step = float(value), float(step)
        except (TypeError, ValueError) as err:
            raise ValueError(f"loss_history[{i}]: {key}={entry.get(key)!r} / step={entry.get('step')!r} are not numbers") from err
        if math.isfinite(value) and math.isfinite(step):
            steps.append(step)
            values.append(value)
    return steps, values


def plot_loss_curve(loss_history: list[dict], path: str | Path) -> bool:
    """Draw training ``loss`` and ``eval_loss`` (nats/byte) against ``step``, and ``eval_bits_per_byte`` in a second
    panel when present, into a PNG at ``path`` (800x400 px per panel row, 100 dpi, Agg backend).

    Args:
        loss_history: ``Trainer.state.log_history`` -- dicts with ``"step"`` and some of ``"loss"``, ``"eval_loss"``,
            ``"eval_bits_per_byte"``; other entries (learning rate, runtime summary) are ignored, non-finite values
            skipped.
        path: output file.

    Returns:
        ``True`` if a PNG was written, ``False`` if there was nothing to plot (no file written).

    Raises:
        TypeError / ValueError: an entry is not a dict, or a value is not a number.
    """
    from matplotlib.figure import Figure

    train = _series(loss_history, "loss")
    evals = _series(loss_history, "eval_loss")
    bpb = _series(loss_history, "eval_bits_per_byte")
    if not (train[0] or evals[0] or bpb[0]):
        return False
    panels = 2 if bpb[0] else 1
    fig = Figure(figsize=(8 if panels == 1 else 11, 4), dpi=100, layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    ax = axes[0]
    if train[0]:
        ax.plot(*train, color="tab:blue", linewidth=1.5, label="training loss")
    if evals[0]:
        ax.plot(*evals, color="tab:orange", linewidth=1.5, marker="o", markersize=4, label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title("Loss")
    ax.grid(True, alpha=0.3)
    if train[0] or evals[0]:
        ax.legend()
    if panels == 2:
        ax2 = axes[1]
        ax2.plot(*bpb, color="tab:green", linewidth=1.5, marker="o", markersize=4, label="held-out bits per byte")
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel("bits per byte")
        ax2.set_title("Held-out bits per byte")
        ax2.grid(True, alpha=0.3)
        ax2.legend()
    fig.savefig(path, format="png")
    return True


# ------------------------------------------------------------------------------------------------ card


def _first(keys: tuple[str, ...], *dicts: dict) -> Any:
    """First finite-number value of ``keys`` in ``dicts`` (in that order), else ``None``."""
    for d in dicts:
        for key in keys:
            value = d.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return value
    return None


def _arch_summary(config: dict, params: float | None) -> str:
    parts = []
    if isinstance(params, (int, float)) and params > 0:
        parts.append(f"{params / 1e6:,.1f}M parameters" if params < 1e9 else f"{params / 1e9:,.2f}B parameters")
    if config.get("hidden_size") is not None:
        parts.append(f"hidden size {config['hidden_size']}")
    layers = [config.get(k) for k in ("num_prelude_layers", "num_recurrent_layers", "num_coda_layers")]
    if all(v is not None for v in layers):
        parts.append(f"{layers[0]} prelude + {layers[1]} recurrent + {layers[2]} coda layers")
    if config.get("n_routed_experts") is not None:
        parts.append(f"{config['n_routed_experts']} experts, top-{config.get('num_experts_per_tok', '?')}")
    if config.get("n_loops") is not None:
        parts.append(f"{config['n_loops']} loops by default")
    return ", ".join(parts) if parts else "configuration not recorded"


def _eval_results(data: dict, metrics: dict):
    from huggingface_hub import EvalResult

    value = _first(BPB_AFTER_KEYS, metrics)
    if value is None:
        return None
    hub = data.get("hub_dataset")
    hub = hub[0] if isinstance(hub, (list, tuple)) and hub else hub
    dataset_name = str(data.get("name") or hub or data.get("source") or "held-out text")
    return [
        EvalResult(
            task_type="text-generation",
            task_name="Byte-level language modelling",
            dataset_type=str(hub or data.get("source") or "custom"),
            dataset_name=dataset_name,
            dataset_split="held-out",
            metric_type="bits_per_byte",
            metric_name="Bits per byte (held-out)",
            metric_value=float(value),
        )
    ]


#: The default recipe's measured comparison with a dense LlamaForCausalLM (``python -m bench.quality --report
#: bench/quality_results.json --write_card_reference hub_card/reference_quality.json``); ships with the card template.
REFERENCE_QUALITY = DEFAULT_TEMPLATE.parent / "reference_quality.json"


def reference_quality(preset: str | None, data: str | None, path: str | Path | None = None) -> dict | None:
    """The benchmark's figures for the default recipe (``bench/quality.py``: Spider's default run against the dense
    baseline at equal parameters and at equal wall-clock, same data and held-out slice), when a run is that recipe's
    preset on that data; else (or when the file is missing) None. The card shows them as the recipe's reference, not
    as this run's own measurement."""
    path = Path(path) if path is not None else REFERENCE_QUALITY
    try:
        ref = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return ref if (preset, data) == (ref.get("preset"), ref.get("data")) else None


def write_model_card(
    release_dir: str | Path,
    *,
    config: dict,
    training: dict,
    data: dict,
    metrics: dict,
    loss_history: list[dict] | None,
    repo_id: str | None,
    template_path: str | Path | None = None,
    model_name: str | None = None,
    bits_per_byte_by_loops: dict | None = None,
    sample: dict | None = None,
    reference: dict | None = None,
    act_early_exit: dict | None = None,
) -> Path:
    """Render the model card into ``release_dir/README.md`` and the loss curve into ``release_dir/loss_curve.png``.

    Args:
        release_dir: existing release folder (weights, ``config.json``, remote-code files, tokenizer files).
        config: model configuration (``SpiderConfig.to_dict()``).
        training / data / metrics: run description; recognised keys in the module docstring.
        loss_history: ``Trainer.state.log_history`` (or ``None``: no curve, the card says so).
        repo_id: Hub repo the card is for (used in the code snippets and as the model name); ``None``: the snippets
            load from ``release_dir``.
        template_path: Jinja template (default :data:`DEFAULT_TEMPLATE`: ``hub_card/model_card.md.j2``).
        model_name: card title and ``model-index`` name (default: the repo name, else ``"Spider"``).
        bits_per_byte_by_loops: ``{loop count (str or int): held-out bits per byte}`` measured after training (the
            recurrent depth's test-time curve; a table on the card), or ``None``.
        sample: ``{"prompt": str, "text": str}``, a greedy continuation of the prompt by the released weights, or None.
        reference: the default recipe's measured comparison with the dense baseline (:func:`reference_quality`),
            shown next to this run's figure; ``None`` when the run is not that recipe.
        act_early_exit: ``{"bits_per_byte", "loops_saved_per_segment", ...}``: held-out bits per byte with ACT early
            exit at inference and the loops it saves per segment (``SpiderTrainer.evaluate_act_early_exit``), or None.

    Returns:
        Path of the written ``README.md``.

    Raises:
        FileNotFoundError: ``release_dir`` or the template does not exist.
        TypeError: ``config`` / ``training`` / ``data`` / ``metrics`` is not a dict, or a history entry is not a dict.
        ValueError: the template uses a variable this function does not provide (names listed), or a history value
            is not a number.
    """
    import jinja2
    import jinja2.meta
    from huggingface_hub import ModelCard, ModelCardData

    release_dir = Path(release_dir)
    if not release_dir.is_dir():
        raise FileNotFoundError(f"release folder does not exist: {release_dir}")
    template = Path(template_path) if template_path is not None else DEFAULT_TEMPLATE
    if not template.is_file():
        raise FileNotFoundError(
            f"model card template not found: {template} (pass template_path=; the default lives in hub_card/ of a "
            "source checkout)"
        )
    config, training, data, metrics = (_check_dict(n, v) for n, v in
                                       (("config", config), ("training", training), ("data", data), ("metrics", metrics)))
    if loss_history is not None and not isinstance(loss_history, list):
        raise TypeError(f"write_model_card: `loss_history` must be a list of dicts or None, got {type(loss_history).__name__}")

    model_name = model_name or (repo_id.split("/")[-1] if repo_id else "Spider")
    curve_path = release_dir / LOSS_CURVE_NAME
    has_curve = bool(loss_history) and plot_loss_curve(loss_history, curve_path)
    if not has_curve and curve_path.exists():
        curve_path.unlink()  # a stale curve from an earlier run must not be shown under this run's card
    remote_code, remote_imports = inspect_remote_code(release_dir)

    precision = str(training.get("precision") or "")
    fp8 = "fp8" in precision.lower() or "float8" in precision.lower()
    hub_datasets = data.get("hub_dataset")
    hub_datasets = [hub_datasets] if isinstance(hub_datasets, str) else list(hub_datasets or [])
    eval_results = _eval_results(data, metrics)
    card_data = ModelCardData(
        language="en",
        license="apache-2.0",
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=BASE_TAGS + (["fp8"] if fp8 else []),
        datasets=hub_datasets or None,
        eval_results=eval_results,
        model_name=model_name if eval_results else None,  # only used to name the model-index entry
    )
    config_table = {k: v for k, v in config.items() if k in CONFIG_LABELS}

    def fmt(value: float | None) -> str | None:
        return None if value is None else f"{value:.3f}"

    def cfg(key: str) -> str:
        return _fmt(key, config[key]) if config.get(key) is not None else "?"

    trained_loops = config.get("n_loops")
    loops_rows = [(f"{n}{' (trained)' if int(n) == trained_loops else ''}", f"{float(v):.4f}")
                  for n, v in sorted((bits_per_byte_by_loops or {}).items(), key=lambda kv: int(kv[0]))]
    kwargs = dict(
        model_name=model_name,
        loops_rows=loops_rows,
        early_exit=None if not act_early_exit else {
            "bits_per_byte": f"{float(act_early_exit['bits_per_byte']):.4f}",
            "loops_saved": f"{float(act_early_exit['loops_saved_per_segment']):.3f}"},
        repo_id=repo_id,
        model_ref=repo_id or str(release_dir),
        arch_summary=_arch_summary(config, _first(PARAMETER_KEYS, training, metrics)),
        cfg=cfg,
        config_rows=_rows(config_table, CONFIG_LABELS),
        config_json=json.dumps({k: v for k, v in config.items() if k not in _CONFIG_NOISE}, indent=2, sort_keys=True,
                               default=str),
        training_rows=_rows(training, TRAINING_LABELS),
        data_rows=_rows(data, DATA_LABELS),
        metric_rows=_rows(metrics, METRIC_LABELS),
        bpb_before=fmt(_first(BPB_BEFORE_KEYS, metrics)),
        bpb_after=fmt(_first(BPB_AFTER_KEYS, metrics)),
        loss_curve=LOSS_CURVE_NAME if has_curve else None,
        has_bpb_curve=has_curve and bool(_series(loss_history, "eval_bits_per_byte")[0]),
        remote_code=remote_code,
        remote_imports=remote_imports,
        requirements=loading_requirements(),
        fp8=fp8,
        weights_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        sample=sample,
        reference=reference,
    )

    source = template.read_text(encoding="utf-8")
    try:
        used = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"model card template {template} line {err.lineno}: {err.message}") from err
    provided = set(kwargs) | set(card_data.to_dict()) | {"card_data"}
    missing = sorted(used - provided)
    if missing:
        raise ValueError(f"model card template {template} uses undefined variable(s) {missing}; "
                         f"available: {sorted(provided)}")

    card = ModelCard.from_template(card_data, template_path=str(template), **kwargs)
    readme = release_dir / "README.md"
    card.save(readme)
    return readme
