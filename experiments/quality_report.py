"""The Model quality section of docs/results.md and the bpb-vs-wall-clock plot, from the rows
``experiments.quality`` measured (JSON lists of rows, e.g. experiments/quality_results.json); the model card's
reference figures from the same rows: :func:`spider_training.model_card.quality_reference`.

``python -m experiments.quality --report q0.json q1.json --write_results docs/results.md --plot docs/quality.png``
calls :func:`render` and :func:`plot`. Which rows are each table's references, the pairs of the "what the global path
adds" table and the plot's labels are data: experiments/quality_rows.json (:func:`experiments.quality.suite`).
"""

from __future__ import annotations

from bench.report import wrap
from configuration_spider import SpiderConfig
from experiments.quality import suite
from spider_training.evaluation import BYTE_KINDS, GLOBAL_STREAM_PROBES
from spider_training.optim import DEFAULT_MUON_LR

SUITE = suite()
#: the rows each table compares with (the rows file's ``references``)
REFERENCES = SUITE["references"]


def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def _headline_rows(rows: list[dict], by_name: dict, suffix: str, optimizer: str) -> list[str]:
    """The first table's rows for one recipe: Spider, the dense Llama at equal parameters and at equal wall-clock
    (best of the learning-rate sweep), the byte layers alone at equal wall-clock; `suffix` ends their names."""
    tech = "pydoc_topics_bits_per_byte"
    spider = by_name.get("spider" if not suffix else REFERENCES["adamw_default"])
    dense = by_name.get(f"llama{suffix}")
    equal_time = [r for r in rows if r.get("group") == f"baseline equal wall-clock{suffix}"]
    best = min(equal_time, key=lambda r: r["sotu_bits_per_byte"]) if equal_time else None
    lines = []

    def line(label, r, bold=False):
        bpb = f"**{_f(r['sotu_bits_per_byte'])}**" if bold else _f(r["sotu_bits_per_byte"])
        muon_lr = (r.get("recipe") or {}).get("muon_lr")  # a swept row's own Muon rate
        label_optimizer = f"Muon (lr {muon_lr:g}) + AdamW" if muon_lr and not suffix else optimizer
        lines.append(
            f"| {label} | {label_optimizer} | {r['steps']} | {r['parameters'] / 1e6:.2f}M | {bpb} | "
            f"{_f(r.get(tech))} |"
        )

    if spider:
        line("Spider `small`" + (" (the default run)" if not suffix else ""), spider, bold=not suffix)
    if dense:
        line(f"`LlamaForCausalLM`, equal parameters and steps (lr {dense['lr']:g})", dense)
    if best:
        sweep = ", ".join(f"{r['lr']:g}: {_f(r['sotu_bits_per_byte'])}" for r in equal_time)
        line(f"`LlamaForCausalLM`, equal wall-clock (best lr {best['lr']:g}; sweep {sweep})", best)
    for group, label in (
        ("local baseline equal parameters", "equal parameters and steps"),
        ("local baseline equal wall-clock", "equal wall-clock"),
    ):
        for r in rows:
            if not suffix and r.get("group") == group:
                line(
                    f"the same dense model with Spider's 4-byte local attention (`MistralForCausalLM`), {label} "
                    f"(lr {r['lr']:g})",
                    r,
                )
    for r in rows:
        if suffix and r.get("group") == f"spider equal wall-clock{suffix}":
            line("Spider `small`, for the default run's wall-clock", r)
    for r in rows:
        if r.get("group") == f"byte layers equal wall-clock{suffix}":
            line("Spider's byte layers alone (global path removed), equal wall-clock", r)
    return lines


def of_default_recipe(row: dict) -> bool:
    """Whether a row trained with the default run's batch size and optimizer split (the rows file's
    ``recipes.default``; rows that do not record them in their ``recipe`` trained with ``recipes.batch8``)."""
    recipe = {**SUITE["recipes"]["batch8"], **(row.get("recipe") or {})}
    return all(recipe[key] == value for key, value in SUITE["recipes"]["default"].items())


def render(rows: list[dict]) -> str:
    """The "Model quality" section of docs/results.md (Markdown) from the suite's rows."""
    by_name = {r["name"]: r for r in rows}
    spider = by_name["spider"]
    batch8 = by_name.get(REFERENCES["batch8_default"], spider)
    adamw_default = by_name.get(REFERENCES["adamw_default"], batch8)
    end_to_end = by_name.get(REFERENCES["end_to_end_default"], batch8)
    equal_time = [r for r in rows if r.get("group") == "baseline equal wall-clock"]
    best = min(equal_time, key=lambda r: r["sotu_bits_per_byte"]) if equal_time else None
    dense = by_name.get("llama")
    xz = spider.get("xz_bits_per_byte")
    lines = [
        "| model | optimizer (batch 16 x 256 unless named) | steps | parameters | held-out bpb (SOTU 2000+) | "
        "technical text bpb (Python reference) |",
        "|---|---|---:|---:|---:|---:|",
        *_headline_rows(rows, by_name, "", f"Muon (lr {spider.get('muon_lr', DEFAULT_MUON_LR):g}) + AdamW"),
        *_headline_rows(rows, by_name, ", AdamW", "AdamW, batch 8 x 256"),
    ]
    if xz is not None:
        lines.append(f"| `xz -9e` on the same slice | - | - | - | {_f(xz)} | - |")
    loops = spider.get("bpb_by_loops", {})
    lines += [
        "",
        "| Spider default run | value |",
        "|---|---:|",
        *(
            f"| held-out bpb at n_loops={n}{' (trained)' if int(n) == spider.get('n_loops') else ''} | {_f(v, 4)} |"
            for n, v in loops.items()
        ),
        f"| training bytes per segment | {_f(spider.get('train_bytes_per_segment'), 2)} |",
        f"| evaluation bytes per segment | {_f(spider.get('eval_bytes_per_segment'), 2)} |",
        f"| mean ACT halting step | {_f(spider.get('mean_halting_step'), 2)} |",
        *(
            [
                f"| with ACT early exit at inference (`act_early_exit=True`): held-out bpb | "
                f"{_f(spider['act_early_exit']['bits_per_byte'], 4)} |",
                f"| with ACT early exit: loops saved per segment (of {spider.get('n_loops')}) | "
                f"{_f(spider['act_early_exit']['loops_saved_per_segment'], 3)} |",
            ]
            if "act_early_exit" in spider
            else []
        ),
        "",
        f"| ablation (one change, same budget; batch 8 x 256 unless named; the AdamW recipe and end-to-end boundaries "
        f"unless Muon is named, compared with the AdamW default run of then, "
        f"{_f(adamw_default['sotu_bits_per_byte'])}; "
        f"Muon rows with end-to-end boundaries with that default under Muon, {_f(end_to_end['sotu_bits_per_byte'])}; "
        f"the other Muon rows with the default run until 2026-11-25, {_f(batch8['sotu_bits_per_byte'])}, and the rows "
        "of today's recipe with the default run) | held-out bpb | vs its default |",
        "|---|---:|---:|",
    ]

    def reference(r: dict) -> dict:  # the default run of the row's own optimizer, batch and segmentation
        if r["name"] == REFERENCES["adamw_default"]:
            return end_to_end  # the optimizer alone
        if r.get("muon_lr") is None:
            return adamw_default
        if r["name"] == REFERENCES["batch8_default"] or of_default_recipe(r):
            return spider
        old_segments = (r.get("overrides") or {}).get("boundary_teacher", "spacelike") is None and r[
            "model"
        ] == "spider"
        return end_to_end if old_segments and r["name"] != REFERENCES["end_to_end_default"] else batch8

    for r in rows:
        if r.get("group") == "ablation":
            ref = reference(r)
            delta = r["sotu_bits_per_byte"] - ref["sotu_bits_per_byte"]
            lines.append(f"| {r['name']} | {_f(r['sotu_bits_per_byte'])} | {delta:+.3f} |")
    for rule, result in spider.get("bpb_by_eval_boundary_rule", {}).items():
        delta = result["bits_per_byte"] - spider["sotu_bits_per_byte"]
        lines.append(
            f"| boundary decision at evaluation: {rule} (same weights; "
            f"{_f(result.get('bytes_per_segment'), 2)} bytes per segment) | {_f(result['bits_per_byte'])} | "
            f"{delta:+.3f} |"
        )
    pairs = [
        (p["label"], by_name[p["spider"]], by_name[p["removed"]])
        for p in SUITE["global_path_pairs"]
        if p["spider"] in by_name and p["removed"] in by_name
    ]
    if pairs:
        lines += [
            "",
            "| what the global path adds: byte layers, budget (batch 8 x 256, AdamW and end-to-end boundaries "
            "unless named) "
            "| steps | Spider | "
            "global path removed | the global path adds |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {label} | {a['steps']} | {_f(a['sotu_bits_per_byte'])} | {_f(b['sotu_bits_per_byte'])} | "
            f"{b['sotu_bits_per_byte'] - a['sotu_bits_per_byte']:+.3f} |"
            for label, a, b in pairs
        ]
    lines += _gain_by_byte_kind(spider, by_name)
    lines += ["", *_targets(spider, by_name, best)]
    samples = [
        (label, r) for label, r in (("Spider", spider), ("Llama (equal parameters)", dense)) if r and "sample" in r
    ]
    if samples:
        lines += [
            "",
            wrap(
                'Samples (temperature 0.8, prompt "The state of the Union is"; real words = share of the sampled '
                f"words that occur in the training addresses, over {samples[0][1].get('real_word_samples', 4)} "
                "200-byte samples):"
            ),
            "",
        ]
        for label, r in samples:
            text = " ".join(r["sample"][:160].split()).replace("`", "'")  # inline code, no backtick inside
            lines.append(wrap(f"- {label} (real words {r['real_word_rate']:.0%}): `{text}`", indent="  "))
    return "\n".join(lines) + "\n"


def _bpb_of_kind(row: dict, kind: str | None) -> float:
    """A row's held-out bits per byte on the bytes of one :data:`BYTE_KINDS` kind, or on every byte (None)."""
    return row["sotu_bits_per_byte"] if kind is None else row["bpb_by_byte_kind"][kind]


def _gain_by_byte_kind(spider: dict, by_name: dict) -> list[str]:
    """Two tables, where the rows carry them: held-out bits per byte by the kind of byte predicted
    (:data:`BYTE_KINDS`) for the default run, its byte layers alone and the dense Llama, and at 4x the steps; and the
    default run (and its 4x) scored with its global stream replaced at evaluation (:data:`GLOBAL_STREAM_PROBES`)."""
    if "bpb_by_byte_kind" not in spider:
        return []
    has_kinds = lambda r: r is not None and "bpb_by_byte_kind" in r  # noqa: E731
    columns = [(label, by_name[name]) for label, name in SUITE["byte_kind_columns"] if has_kinds(by_name.get(name))]
    gains = [
        (label, by_name.get(a), by_name.get(b))
        for label, (a, b) in (
            ("the global path adds", ("spider", REFERENCES["byte_layers_alone"])),
            ("the global path adds, batch 8, 4x the steps", REFERENCES["four_x"]),
        )
    ]
    gains = [(label, a, b) for label, a, b in gains if has_kinds(a) and has_kinds(b)]
    header = ["byte predicted", "share of the bytes", "Spider (the default run)", *(c for c, _ in columns)]
    header += [label for label, _, _ in gains]
    lines = ["", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for kind in (*BYTE_KINDS, None):
        share = 1.0 if kind is None else spider["byte_kind_shares"][kind]
        cells = [
            kind or "**every byte**",
            f"{share:.1%}",
            _f(_bpb_of_kind(spider, kind)),
            *(_f(_bpb_of_kind(r, kind)) for _, r in columns),
            *(f"{_bpb_of_kind(b, kind) - _bpb_of_kind(a, kind):+.3f}" for _, a, b in gains),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    probed = [
        (label, r)
        for label, r in (("the default run", spider), ("batch 8, 4x the steps", by_name.get(REFERENCES["four_x"][0])))
        if r and r.get("bpb_by_global_stream_probe")
    ]
    if probed:
        first = BYTE_KINDS[1]
        header = ["Spider's global stream at evaluation (same weights), held-out bpb against the trained stream's"]
        header += [f"{label}: {part}" for label, _ in probed for part in ("every byte", first)]
        lines += ["", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for probe in (p for p in GLOBAL_STREAM_PROBES if all(p in r["bpb_by_global_stream_probe"] for _, r in probed)):
            cells = [probe]
            for _, r in probed:
                result = r["bpb_by_global_stream_probe"][probe]
                cells += [
                    f"{result['bits_per_byte'] - r['sotu_bits_per_byte']:+.3f}",
                    f"{result['by_byte_kind'][first] - r['bpb_by_byte_kind'][first]:+.3f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _targets(spider: dict, by_name: dict, best_equal_time: dict | None) -> list[str]:
    """The quality targets as a table: what was measured and whether it was met."""
    cfg = SpiderConfig.from_preset("small")
    bpb = spider["sotu_bits_per_byte"]
    rows = []

    def target(name, measured, met):
        rows.append(f"| {name} | {measured} | {'yes' if met else '**no**'} |")

    if best_equal_time:
        ref = best_equal_time["sotu_bits_per_byte"]
        target(
            "held-out bpb at or below the dense baseline at equal wall-clock", f"{bpb:.3f} vs {ref:.3f}", bpb <= ref
        )
        t, tr = spider.get("pydoc_topics_bits_per_byte"), best_equal_time.get("pydoc_topics_bits_per_byte")
        if t is not None and tr is not None:
            target(
                "technical text: no worse than the dense baseline by more than 0.05",
                f"{t:.3f} vs {tr:.3f}",
                t <= tr + 0.05,
            )
    xz = spider.get("xz_bits_per_byte")
    if xz is not None:
        target("held-out bpb below `xz -9e`", f"{bpb:.3f} vs {xz:.3f}", bpb < xz)
    removed = by_name.get(REFERENCES["byte_layers_alone"])
    if removed:
        gain = removed["sotu_bits_per_byte"] - bpb
        target("the global path pays: removing it costs at least 0.10 bpb", f"{gain:+.3f}", gain >= 0.10)
    loops = {int(k): v for k, v in spider.get("bpb_by_loops", {}).items()}
    n = spider.get("n_loops")
    if n in loops and 1 in loops and 2 * n in loops:
        target("1 loop is worse than the trained count", f"{loops[1]:.4f} vs {loops[n]:.4f}", loops[1] > loops[n])
        target(
            "twice the trained count no worse than it by more than 0.01",
            f"{loops[2 * n] - loops[n]:+.4f}",
            loops[2 * n] <= loops[n] + 0.01,
        )
    ev, tr = spider.get("eval_bytes_per_segment"), spider.get("train_bytes_per_segment")
    if ev and tr:
        low = cfg.boundary_prior - cfg.boundary_prior_k * cfg.boundary_prior_std
        band = (1 / cfg.boundary_prior, 1 / low)
        target(
            "evaluation bytes per segment within 25% of training's", f"{ev:.2f} vs {tr:.2f}", abs(ev / tr - 1) <= 0.25
        )
        target(
            f"evaluation bytes per segment inside the prior's band ({band[0]:.2f}-{band[1]:.2f})",
            f"{ev:.2f}",
            band[0] <= ev <= band[1],
        )
    dense = by_name.get("llama")
    if dense and "real_word_rate" in spider and "real_word_rate" in dense:
        target(
            "samples are real words at least as often as the dense baseline's",
            f"{spider['real_word_rate']:.0%} vs {dense['real_word_rate']:.0%}",
            spider["real_word_rate"] >= dense["real_word_rate"],
        )
    return ["| target | measured | met |", "|---|---|---|", *rows] if rows else []


def plot(rows: list[dict], path: str) -> list[str]:
    """Held-out bpb against training wall-clock, Spider and the dense baseline: the default runs of each recipe and
    their Llama baselines, where their rows have a ``curve``, written to `path`. Returns the labels of the curves
    drawn, in order; none (and no file) when no such row has a curve."""
    from matplotlib.figure import Figure

    labels = SUITE["plot_labels"]
    curves = [(r["name"], r["curve"]) for r in rows if r.get("curve") and r["name"] in labels]
    if not curves:
        return []
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for name, curve in curves:
        label = labels[name]
        ax.plot(
            [c["seconds"] for c in curve], [c["bits_per_byte"] for c in curve], marker="o", markersize=3, label=label
        )
    ax.set_xlabel("training wall-clock (s, one thread)")
    ax.set_ylabel("held-out bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return [labels[name] for name, _ in curves]
