"""Write the release folder's ``README.md`` model card and ``loss_curve.png`` for a Spider training run.

:func:`write_model_card` fills ``hub_card/model_card.md.j2`` through ``huggingface_hub.ModelCard.from_template`` with a
``ModelCardData`` front matter (tags, Hub datasets, a ``model-index`` entry with the held-out bits per byte) and draws
the loss curve with a matplotlib ``Figure`` (no pyplot state: safe in any thread). What the card says is data in
``hub_card/``: the wording in the template; labels, tags, the keys that mean one quantity (old and Trainer-style
metric names) and the flagged modules in ``card_labels.json`` (:data:`LABELS`). Keys without a label are shown under
their own name, ``None`` values left out; ``*_bytes`` keys get a MiB figure, ``*_s`` seconds. The remote-code section
lists the files found in the folder with their sha256 and the modules they import (parsed with ``ast``).
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
#: ``hub_card/card_labels.json`` (its ``about`` entry says what each table holds).
LABELS: dict[str, Any] = json.loads((DEFAULT_TEMPLATE.parent / "card_labels.json").read_text(encoding="utf-8"))
#: Loss-curve file name inside the release folder (the card links to it relatively).
LOSS_CURVE_NAME = "loss_curve.png"


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
    elif isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    elif isinstance(value, float):
        big_or_tiny = value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6)
        text = (
            f"{value:,.1f} s"
            if key.endswith("_s")
            else f"{value:.3g}"
            if big_or_tiny
            else f"{value:,.0f}"
            if abs(value) >= 100
            else f"{value:.4g}"
        )
    elif isinstance(value, (list, tuple)):
        text = ", ".join(_fmt(key, v) for v in value) if value else "none"
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, default=str)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(values: dict, table: str) -> list[tuple[str, str]]:
    """Table rows: keys with a label in ``LABELS[table]`` first (in its order), then the rest under their own name."""
    labels = LABELS[table]
    rows = [(label, _fmt(key, values[key])) for key, label in labels.items() if values.get(key) is not None]
    return rows + [(f"`{k}`", _fmt(k, v)) for k, v in values.items() if k not in labels and v is not None]


def _first(quantity: str, *dicts: dict) -> Any:
    """First finite number under any of ``LABELS["same_quantity"][quantity]`` in ``dicts`` (in order), else None."""
    for d in dicts:
        for key in LABELS["same_quantity"][quantity]:
            value = d.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return value
    return None


def loading_requirements(distribution: str = "spider-lm") -> list[str]:
    """The installed ``distribution``'s requirements outside its extras (e.g. ``["torch>=2.8", ...]``: what loading a
    release needs); ``[]`` when it is not installed (the card then says nothing rather than something stale)."""
    from importlib import metadata

    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    return [req for req in requires if "extra ==" not in req]


def inspect_remote_code(folder: str | Path) -> tuple[list[dict], dict[str, list[str]]]:
    """Describe the remote-code files (``LABELS["remote_code_files"]``) of a release folder.

    Returns ``(files, imports)``: ``files`` has one dict per expected file (``name``, ``role``, ``present``,
    ``sha256`` hex or ``None``); ``imports`` maps ``"third_party"``, ``"stdlib"``, ``"local"`` (the folder's own
    modules) and ``"risky"`` (``LABELS["risky_modules"]``) to the sorted top-level modules that any ``import`` in
    the present files names. Raises ``SyntaxError`` (naming the file) when a present file does not parse.
    """
    folder = Path(folder)
    files, modules, local = [], set(), set()
    own = {Path(n).stem for n in LABELS["remote_code_files"]}
    for name, role in LABELS["remote_code_files"].items():
        path = folder / name
        present = path.is_file()
        files.append(
            {
                "name": name,
                "role": role,
                "present": present,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if present else None,
            }
        )
        if not present:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as err:
            raise SyntaxError(f"remote-code file {path} does not parse: {err}") from err
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level:  # relative import: a file of this folder
                local.add(node.module or "")
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules.add(node.module.split(".")[0])
    local = (local | (modules & own)) - {""}
    modules -= own
    stdlib = {m for m in modules if m in sys.stdlib_module_names or m == "__future__"}
    return files, {
        "third_party": sorted(modules - stdlib),
        "stdlib": sorted(stdlib - {"__future__"}),
        "local": sorted(local),
        "risky": sorted(modules & set(LABELS["risky_modules"])),
    }


def _series(history: list[dict], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of the finite ``key`` entries of a ``log_history`` (errors as :func:`plot_loss_curve`)."""
    points = []
    for i, entry in enumerate(history):
        if not isinstance(entry, dict):
            raise TypeError(f"loss_history[{i}] must be a dict (Trainer.state.log_history entry), got {entry!r}")
        value, step = entry.get(key), entry.get("step")
        if value is None or step is None:
            continue
        try:
            value, step = float(value), float(step)
        except (TypeError, ValueError) as err:
            raise ValueError(f"loss_history[{i}]: {key}={value!r} / step={step!r} are not numbers") from err
        if math.isfinite(value) and math.isfinite(step):
            points.append((step, value))
    return [p[0] for p in points], [p[1] for p in points]


def plot_loss_curve(loss_history: list[dict], path: str | Path) -> bool:
    """Draw ``loss`` and ``eval_loss`` (nats/byte) against ``step``, and ``eval_bits_per_byte`` in a second panel
    when present, from ``loss_history`` (``Trainer.state.log_history``; other keys ignored, non-finite values
    skipped) into a PNG at ``path`` (800x400 px, 1100x400 with two panels). Returns whether a PNG was written
    (``False``: nothing to plot). Raises ``TypeError`` / ``ValueError`` for an entry that is not a dict / a value
    that is not a number."""
    from matplotlib.figure import Figure

    train, evals, bpb = (_series(loss_history, k) for k in ("loss", "eval_loss", "eval_bits_per_byte"))
    if not (train[0] or evals[0] or bpb[0]):
        return False
    panels = 2 if bpb[0] else 1
    fig = Figure(figsize=(8 if panels == 1 else 11, 4), dpi=100, layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    if train[0]:
        axes[0].plot(*train, color="tab:blue", linewidth=1.5, label="training loss")
    if evals[0]:
        axes[0].plot(*evals, color="tab:orange", linewidth=1.5, marker="o", markersize=4, label="held-out loss")
    axes[0].set(xlabel="optimizer step", ylabel="loss (nats / byte)", title="Loss")
    if panels == 2:
        axes[1].plot(*bpb, color="tab:green", linewidth=1.5, marker="o", markersize=4, label="held-out bits per byte")
        axes[1].set(xlabel="optimizer step", ylabel="bits per byte", title="Held-out bits per byte")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.savefig(path, format="png")
    return True


def _arch_summary(config: dict, params: float | None) -> str:
    """One line: parameters, width, layer counts, experts, default loops (what of them ``config`` records)."""
    c = config.get
    layers = [c(k) for k in ("num_prelude_layers", "num_recurrent_layers", "num_coda_layers")]
    parts = [
        params > 0 and (f"{params / 1e6:,.1f}M parameters" if params < 1e9 else f"{params / 1e9:,.2f}B parameters"),
        c("hidden_size") is not None and f"hidden size {c('hidden_size')}",
        None not in layers and f"{layers[0]} prelude + {layers[1]} recurrent + {layers[2]} coda layers",
        c("n_routed_experts") is not None and f"{c('n_routed_experts')} experts, top-{c('num_experts_per_tok', '?')}",
        c("n_loops") is not None and f"{c('n_loops')} loops by default",
    ]
    return ", ".join(p for p in parts if p) or "configuration not recorded"


#: The default recipe's comparison with a dense LlamaForCausalLM (:func:`quality_reference`), written by
#: ``python -m experiments.quality --report experiments/quality_results.json --write_card_reference
#: hub_card/reference_quality.json``.
REFERENCE_QUALITY = DEFAULT_TEMPLATE.parent / "reference_quality.json"


def reference_quality(preset: str | None, data: str | None, path: str | Path | None = None) -> dict | None:
    """``experiments/quality.py``'s figures of the default recipe (Spider against the dense baseline at equal
    parameters and equal wall-clock) from ``path`` (default :data:`REFERENCE_QUALITY`) when ``(preset, data)`` is that
    recipe's; else, or when the file is missing, None. The card shows them as the recipe's reference, not this
    run's."""
    path = Path(path) if path is not None else REFERENCE_QUALITY
    try:
        ref = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return ref if (preset, data) == (ref.get("preset"), ref.get("data")) else None


def quality_reference(rows: list[dict], byte_layers_alone: str) -> dict:
    """What :func:`reference_quality` reads, from the rows of ``python -m experiments.quality --report
    ROWS.json --write_card_reference FILE``): the default run (row ``spider``), the dense baseline at equal parameters
    (``llama``) and at equal wall-clock (the best swept learning rate of the group ``baseline equal wall-clock``), and
    the same byte layers without the global path (the row named `byte_layers_alone`), in held-out bits per byte (3
    decimals)."""
    by_name = {r["name"]: r for r in rows}
    spider, llama, bytes_only = by_name["spider"], by_name["llama"], by_name[byte_layers_alone]
    equal_time = min(
        (r for r in rows if r.get("group") == "baseline equal wall-clock"), key=lambda r: r["sotu_bits_per_byte"]
    )
    millions = lambda r: f"{r['parameters'] / 1e6:.2f}M"  # noqa: E731
    bpb = lambda r: "-" if r["sotu_bits_per_byte"] is None else f"{r['sotu_bits_per_byte']:.3f}"  # noqa: E731
    return {
        "preset": "small",
        "data": "sotu",
        "steps": spider["steps"],
        "spider_parameters": millions(spider),
        "spider_bits_per_byte": bpb(spider),
        "llama_parameters": millions(llama),
        "llama_bits_per_byte": bpb(llama),
        "llama_equal_time_bits_per_byte": bpb(equal_time),
        "bytes_only_parameters": millions(bytes_only),
        "bytes_only_bits_per_byte": bpb(bytes_only),
    }


#: Spider's greedy decoding speed beside its dense peers for a preset (:func:`generation_reference`), written by
#: ``python -m bench.generation --write_card_reference bench/generation_cpu.json hub_card/reference_generation.json``.
REFERENCE_GENERATION = DEFAULT_TEMPLATE.parent / "reference_generation.json"


def reference_generation(preset: str | None, path: str | Path | None = None) -> dict | None:
    """``bench/generation.py``'s table (cached greedy bytes/s of Spider at its loop counts and caches beside a dense
    ``LlamaForCausalLM`` and ``MistralForCausalLM`` of its size) from ``path`` (default :data:`REFERENCE_GENERATION`)
    when it was measured for `preset`; else, or when the file is missing, None. The card shows it as the preset's
    reference at initialisation, not this run's measurement (speed does not depend on the weights' values)."""
    path = Path(path) if path is not None else REFERENCE_GENERATION
    try:
        ref = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return ref if preset == ref.get("preset") else None


def generation_reference(results: dict, machine: str = "a 2-core CPU, 2 threads") -> dict:
    """What :func:`reference_generation` reads, from a full ``python -m bench.run_all`` JSON (``python -m
    bench.generation --write_card_reference RESULTS.json FILE``): Spider's rows at each loop count and cache (ACT
    early exit beside), each dense peer's caches on one row."""
    generation = results["benchmarks"]["generation"]
    rows, sizes = generation["measurements"]["peers"]["bytes_per_s"], generation["sizes"]
    loop_counts = sorted({int(k.split("_")[1].removeprefix("loops")) for k in rows if k.startswith("spider_")})
    trained = sorted(loop_counts)[len(loop_counts) // 2]  # 1, trained, 2x trained

    def spider_row(loops: int, cache: str, suffix: str) -> dict | None:
        name = f"spider_loops{loops}"
        if name + suffix not in rows:
            return None
        label = f"Spider, {loops} loop{'s' if loops > 1 else ''}" + (" (trained)" if loops == trained else "")
        early = rows.get(f"{name}_act_early_exit{suffix}")
        value = f"{rows[name + suffix]:.0f}" + (f" (ACT early exit: {early:.0f})" if early is not None else "")
        return {"model": label, "cache": cache, "bytes_per_s": value}

    table = [
        row
        for loops in loop_counts
        for cache, suffix in (("`SpiderCache`", ""), ("`SpiderStaticCache`, compiled", "_static_compiled"))
        if (row := spider_row(loops, cache, suffix)) is not None
    ]
    for peer, label in (("llama", "dense `LlamaForCausalLM`"), ("mistral", "`MistralForCausalLM`, local attention")):
        caches = [c for c in ("dynamic", "static", "static_compiled") if f"{peer}_{c}" in rows]
        table.append(
            {
                "model": label,
                "cache": " / ".join(c.replace("_", " ") for c in caches),
                "bytes_per_s": " / ".join(f"{rows[f'{peer}_{c}']:.0f}" for c in caches),
            }
        )
    return {
        "preset": sizes["preset"],
        "machine": machine,
        "prompt_len": sizes["prompt_len"],
        "new_tokens": sizes["new_tokens"],
        "rows": table,
    }


def _loops_finding(bits_per_byte_by_loops: dict | None, trained: int | None) -> str:
    """The card's sentence on what more loops did for this checkpoint, from its own loop table (never a claim the
    table does not show)."""
    if not bits_per_byte_by_loops:
        return "whether more loops help is measured per checkpoint"
    scores = {int(n): float(v) for n, v in bits_per_byte_by_loops.items()}
    best, most = min(scores, key=scores.get), max(scores)
    where = " (the trained count)" if best == trained else f" (trained with {trained})" if trained else ""
    if len(scores) == 1:
        return f"this checkpoint was measured at {best} loop{'s' if best != 1 else ''} only (the loop table below)"
    if best == most:
        return f"on this checkpoint's held-out text the most loops tried ({most}) scored best (the loop table below)"
    return (
        f"on this checkpoint's held-out text {best} loop{'s' if best != 1 else ''} scored best{where}; more did not "
        "help (the loop table below)"
    )


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
    compute_map: str | None = None,
    generation_reference: dict | None = None,
) -> Path:
    """Render the model card into ``release_dir/README.md`` and the loss curve into ``release_dir/loss_curve.png``.

    Args:
        release_dir: existing release folder (weights, ``config.json``, remote-code files, tokenizer files).
        config: ``SpiderConfig.to_dict()`` (the full dict: a missing field shows as ``?``).
        training / data / metrics: the run's description and figures (labels: :data:`LABELS`).
        loss_history: ``Trainer.state.log_history``, or ``None`` (no curve; the card says so).
        repo_id: Hub repo the snippets load and the default model name; ``None``: they load ``release_dir``.
        template_path: Jinja template (default :data:`DEFAULT_TEMPLATE`).
        model_name: title and ``model-index`` name (default: the repo name, else ``"Spider"``).
        bits_per_byte_by_loops: ``{loop count (str or int): held-out bits per byte}`` after training, or None.
        sample: ``{"prompt": str, "text": str}``: a greedy continuation by the released weights, or None.
        reference: :func:`reference_quality`'s figures, or None.
        act_early_exit: ``{"bits_per_byte", "loops_saved_per_segment", ...}`` with ACT early exit, or None.
        compute_map: the file name of a held-out paragraph's compute map in ``release_dir``, or None.
        generation_reference: :func:`reference_generation`'s table, or None.

    Returns:
        Path of the written ``README.md``.

    Raises:
        FileNotFoundError: ``release_dir`` or the template does not exist.
        TypeError: ``config`` / ``training`` / ``data`` / ``metrics`` is not a dict, or a history entry is not a dict.
        ValueError: the template uses a variable this function does not provide (names listed), or a history value
            is not a number.
        jinja2.TemplateSyntaxError: the template does not parse (line and reason given).
    """
    import jinja2
    import jinja2.meta
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    release_dir = Path(release_dir)
    if not release_dir.is_dir():
        raise FileNotFoundError(f"release folder does not exist: {release_dir}")
    template = Path(template_path) if template_path is not None else DEFAULT_TEMPLATE
    if not template.is_file():
        raise FileNotFoundError(
            f"model card template not found: {template} (pass template_path=; the default "
            "lives in hub_card/ of a source checkout)"
        )
    inputs = {"config": config, "training": training, "data": data, "metrics": metrics, "loss_history": loss_history}
    for name, value in inputs.items():
        kind = list if name == "loss_history" else dict
        if value is not None and not isinstance(value, kind):
            raise TypeError(
                f"write_model_card: `{name}` must be a {kind.__name__} or None, got {type(value).__name__}"
            )
    config, training, data, metrics = (d or {} for d in (config, training, data, metrics))

    model_name = model_name or (repo_id.split("/")[-1] if repo_id else "Spider")
    curve_path = release_dir / LOSS_CURVE_NAME
    has_curve = bool(loss_history) and plot_loss_curve(loss_history, curve_path)
    if not has_curve and curve_path.exists():
        curve_path.unlink()  # a stale curve from an earlier run must not be shown under this run's card
    remote_code, remote_imports = inspect_remote_code(release_dir)
    precision = str(training.get("precision") or "").lower()
    fp8 = "fp8" in precision or "float8" in precision
    hub_datasets = data.get("hub_dataset")
    hub_datasets = [hub_datasets] if isinstance(hub_datasets, str) else list(hub_datasets or [])
    bpb_after, hub = _first("bits_per_byte_after", metrics), (hub_datasets or [None])[0]
    eval_results = (
        None
        if bpb_after is None
        else [
            EvalResult(
                **LABELS["eval_result"],
                metric_value=float(bpb_after),
                dataset_type=str(hub or data.get("source") or "custom"),
                dataset_name=str(data.get("name") or hub or data.get("source") or "held-out text"),
            )
        ]
    )
    card_data = ModelCardData(
        **LABELS["card_data"],
        tags=LABELS["base_tags"] + (["fp8"] if fp8 else []),
        datasets=hub_datasets or None,
        eval_results=eval_results,
        model_name=model_name if eval_results else None,
    )  # names the model-index entry

    def cfg(key: str) -> str:
        return _fmt(key, config[key]) if config.get(key) is not None else "?"

    loops_rows = [
        (f"{n}{' (trained)' if int(n) == config.get('n_loops') else ''}", f"{float(v):.4f}")
        for n, v in sorted((bits_per_byte_by_loops or {}).items(), key=lambda kv: int(kv[0]))
    ]
    kwargs = dict(
        model_name=model_name,
        loops_rows=loops_rows,
        loops_finding=_loops_finding(bits_per_byte_by_loops, config.get("n_loops")),
        code_files=sorted(path.name for path in Path(release_dir).glob("*.py")),
        repo_id=repo_id,
        model_ref=repo_id or str(release_dir),
        early_exit=None
        if not act_early_exit
        else {
            "bits_per_byte": f"{float(act_early_exit['bits_per_byte']):.4f}",
            "loops_saved": f"{float(act_early_exit['loops_saved_per_segment']):.3f}",
        },
        arch_summary=_arch_summary(config, _first("parameters", training, metrics) or 0),
        cfg=cfg,
        config_rows=_rows({k: v for k, v in config.items() if k in LABELS["config_labels"]}, "config_labels"),
        config_json=json.dumps(
            {k: v for k, v in config.items() if k not in LABELS["config_noise"]}, indent=2, sort_keys=True, default=str
        ),
        training_rows=_rows(training, "training_labels"),
        data_rows=_rows(data, "data_labels"),
        metric_rows=_rows(metrics, "metric_labels"),
        **{
            f"bpb_{when}": None if value is None else f"{value:.3f}"
            for when, value in (("before", _first("bits_per_byte_before", metrics)), ("after", bpb_after))
        },
        loss_curve=LOSS_CURVE_NAME if has_curve else None,
        has_bpb_curve=has_curve and bool(_series(loss_history, "eval_bits_per_byte")[0]),
        remote_code=remote_code,
        remote_imports=remote_imports,
        requirements=loading_requirements(),
        fp8=fp8,
        weights_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        sample=sample,
        reference=reference,
        generation_reference=generation_reference,
        compute_map=compute_map if compute_map and (release_dir / compute_map).is_file() else None,
    )

    # ModelCard.from_template renders an unknown variable as "": name it instead of shipping an empty section
    used = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template.read_text(encoding="utf-8")))
    provided = set(kwargs) | set(card_data.to_dict()) | {"card_data"}
    if used - provided:
        raise ValueError(
            f"model card template {template} uses undefined variable(s) {sorted(used - provided)}; "
            f"available: {sorted(provided)}"
        )
    readme = release_dir / "README.md"
    ModelCard.from_template(card_data, template_path=str(template), **kwargs).save(readme)
    return readme
