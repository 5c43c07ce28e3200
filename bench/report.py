"""Markdown "Performance on CPU" section of ``docs/results.md`` from a ``bench.run_all`` JSON file.

``python -m bench.report bench/results.json`` prints the section; ``--write-results docs/results.md`` replaces the text
between the markers ``<!-- bench:start -->`` and ``<!-- bench:end -->`` in that file (the markers stay; everything
else is untouched). The section: a line with the environment (torch, threads, CPU, quick or full sizes), a table
``| Benchmark | Target | Measured | Met |`` with one row per check (and per reported figure without target), the
benchmarks that errored, and the profile hot spots of missed targets. Its paragraphs and hot-spot items are wrapped
at 119 columns (:func:`wrap`); a table row stays one line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
#: the Markdown's line length, the Python's (``pyproject.toml``'s ruff setting)
WIDTH = 119


#: a word that would open a Markdown block at the start of a line (heading, quote, table, HTML, list item, fence,
#: setext underline): :func:`wrap` never breaks a line before one
BLOCK_START = re.compile(r"[#>|<=+*-]|\d+[.)]$|```|~~~")


def wrap(text: str, indent: str = "") -> str:
    """`text` (one paragraph or list item of Markdown, e.g. a model's sample as inline code) broken greedily at spaces
    into lines of at most :data:`WIDTH` characters, continuation lines indented by `indent`. Words are never split and
    no line starts with a word matching :data:`BLOCK_START` (the break moves back to an earlier word), so the text
    renders as it did on one line; a line runs over :data:`WIDTH` only where no word of it may start the next. Runs of
    spaces become one."""
    lines, line = [], []  # finished lines; the words of the current one

    def width(words: list[str]) -> int:
        return len(indent if lines else "") + len(" ".join(words))

    for word in text.split():
        line.append(word)
        if width(line) <= WIDTH:
            continue
        cuts = [k for k in range(len(line) - 1, 0, -1) if not BLOCK_START.match(line[k])]  # may start a line
        cut = next((k for k in cuts if width(line[:k]) <= WIDTH), cuts[-1] if cuts else None)
        if cut is not None:
            lines.append(" ".join(line[:cut]))
            line = line[cut:]
    lines.append(" ".join(line))
    return f"\n{indent}".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def render(results: dict) -> str:
    """The Markdown section for a ``run_all`` result dict. Raises ``ValueError`` if it has no ``benchmarks``."""
    if "benchmarks" not in results:
        raise ValueError("not a bench.run_all result: no 'benchmarks' key")
    env = results.get("environment", {})
    lines = [
        "## Performance on CPU",
        "",
        wrap(
            f"Measured with `python -m bench.run_all{' --quick' if results.get('quick') else ''}` "
            f"(torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, "
            f"{env.get('torch_num_threads', '?')} threads, {env.get('cpu', '?')}, CPU only"
            f"{', quick toy sizes' if results.get('quick') else ''}). Every figure is a ratio of two variants timed "
            "side by side in one process (median of repeats after warm-up); see `bench/README.md`."
        ),
        "",
        "| Benchmark | Target | Measured | Met |",
        "|---|---|---|---|",
    ]
    errors = []
    for name, r in results["benchmarks"].items():
        if "error" in r:
            errors.append((name, r["error"]))
            lines.append(f"| {name} | - | error | no |")
            continue
        for c in r.get("checks", []):
            target = f"{c.get('comparison', '>=')} {_fmt(c['target'])}"
            lines.append(
                f"| {c['name']} ({c['metric']}) | {target} | {_fmt(c['measured'])} | {'yes' if c['met'] else 'no'} |"
            )
        for i in r.get("info", []):
            lines.append(f"| {i['name']} | - | {_fmt(i['measured'])} {i['unit']} | - |")
        if "outputs_equal" in r:
            lines.append(f"| {name}: cached and uncached outputs equal | - | {r['outputs_equal']} | - |")
    if errors:
        lines += ["", "Errors:"] + [f"- `{n}`: {e.splitlines()[0][:300]}" for n, e in errors]
    hot = [(n, r["profile"]) for n, r in results["benchmarks"].items() if r.get("profile")]
    if hot:
        lines += ["", "Hot spots where a target is missed (torch.profiler, self CPU time):"]
        for name, prof in hot:
            for variant, p in prof.items():
                top = ", ".join(f"`{t['op']}` {t['self_cpu_pct']:.0f}%" for t in p.get("top", [])[:5])
                lines.append(wrap(f"- {name} / {variant}: {top}", indent="  "))
    return "\n".join(lines) + "\n"


def write_block(path: str | Path, section: str, start: str = START, end: str = END) -> None:
    """Replace the text between the markers `start` and `end` (default :data:`START`, :data:`END`) in ``path``
    with ``section``.

    Raises ``ValueError`` naming the file if a marker is missing, duplicated or out of order."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"{path} must contain exactly one {start} followed by exactly one {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{section}{end}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", default="bench/results.json", help="run_all JSON file")
    parser.add_argument(
        "--write-results",
        metavar="RESULTS_MD",
        default=None,
        help="replace the text between the bench markers in this file (docs/results.md)",
    )
    args = parser.parse_args(argv)
    try:
        section = render(json.loads(Path(args.results).read_text(encoding="utf-8")))
        if args.write_results:
            write_block(args.write_results, section)
    except (OSError, ValueError) as e:
        print(f"bench.report: error: {e}", file=sys.stderr)
        return 2
    print(section, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
