"""Held-out bits per byte of a saved Spider release: ``spider-evaluate RELEASE_DIR [--text FILE] [--n_loops N ...]``.

Loads the folder as a user of the Hub would (``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``)
and scores it with :mod:`spider_training.evaluation`: by default on the held-out slice every published figure uses
(the SOTU addresses from 2000 on, 32 KB a third of the way in, windows of 256 predicted bytes), with ``--text`` on
the first ``--max_bytes`` bytes of a UTF-8 text file instead. Each loop count asked (default: the release's
``n_loops``) gets its bits per byte, bits per byte by the kind of byte predicted (space or punctuation, the 1st, 2nd,
... byte of a word) with each kind's share, and bytes per segment. ``--probes`` adds what the figure rests on, as the
results tables' Spider rows show it (:func:`spider_training.evaluation.probe_spider`: the loop sweep, ACT early exit,
the global stream replaced, other boundary rules at the release's own rate on these windows). Prints one JSON object
on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys


def evaluate(
    model,
    ids,
    n_loops: list[int] | None = None,
    seq_len: int = 256,
    max_bytes: int = 32 * 1024,
    start_fraction: float = 0.0,
    batch_size: int = 16,
    probes: bool = False,
) -> dict:
    """Score `model` on the id stream `ids` (int64 numpy ``(N,)``, :func:`spider_training.evaluation.corpus_bytes` or
    :func:`~spider_training.evaluation.text_file_ids`): windows of `seq_len` predicted bytes from a `max_bytes` slice
    starting at `start_fraction` of the stream, at each loop count of `n_loops` (default: the model's
    ``config.n_loops``). Returns ``{"predicted_bytes": int, "seq_len": int, "n_loops": {str(n): score}}``, each score
    :func:`spider_training.evaluation.score`'s (bits per byte, by byte kind, bytes per segment); with `probes` also
    ``"probes"``, :func:`spider_training.evaluation.probe_spider`'s, its rate-matched boundary rule at the model's own
    bytes per segment on these windows. Raises ``ValueError`` for a loop count below 1 or a text shorter than one
    window."""
    from ..evaluation import heldout_windows, probe_spider, score

    counts = n_loops or [model.config.n_loops]
    if min(counts) < 1:
        raise ValueError(f"--n_loops must be at least 1, got {min(counts)}")
    windows = heldout_windows(ids, seq_len, slice_bytes=max_bytes, start_fraction=start_fraction)
    by_loops = {str(n): score(model, windows, n_loops=n, batch_size=batch_size, by_byte_kind=True) for n in counts}
    result = {"predicted_bytes": int(windows[:, 1:].numel()), "seq_len": seq_len, "n_loops": by_loops}
    if probes:
        rate = score(model, windows, batch_size=batch_size).get("bytes_per_segment")
        result["probes"] = probe_spider(model, windows, rate)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("release", help="a saved Spider folder (a training release or checkpoint)")
    parser.add_argument("--text", default=None, help="UTF-8 text file to score (default: the held-out SOTU slice)")
    parser.add_argument("--n_loops", type=int, nargs="+", default=None, help="loop counts (default: the release's)")
    parser.add_argument("--max_bytes", type=int, default=32 * 1024, help="bytes of the text scored")
    parser.add_argument("--seq_len", type=int, default=256, help="predicted bytes per window (the context)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument(
        "--probes",
        action="store_true",
        help="also the loop sweep, ACT early exit, the global stream replaced and other boundary rules",
    )
    args = parser.parse_args(argv)

    import torch

    from ..evaluation import corpus_bytes, text_file_ids
    from .generate import load

    try:
        ids = text_file_ids(args.text) if args.text else corpus_bytes("eval")
        model, _ = load(args.release)
        model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # the SOTU slice starts a third of the way in, as every published figure's; a text file from its start
        start = 0.0 if args.text else 1 / 3
        result = evaluate(
            model, ids, args.n_loops, args.seq_len, args.max_bytes, start, args.batch_size, probes=args.probes
        )
    except (ImportError, OSError, ValueError) as error:  # no sotu package, no file or folder, bad input
        sys.exit(f"spider-evaluate: {error}")
    result = {"release": args.release, "text": args.text or "SOTU addresses from 2000 on (held-out slice)", **result}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
