"""Where Spider spends its compute on a text: ``python -m spider_training.commands.compute_map RELEASE --text TEXT``.

:func:`compute_map` runs the model once and returns a :class:`ComputeMap`: per byte the boundary probability, the
decision and its segment; per segment the loops ACT ran and each loop's weight; per loop and recurrent layer the
routed experts and their weights. Everything is read from what that one forward returns (``output_router_logits=True``:
the ACT loop weights and each layer's router logits, whose top-k is taken with the MoE's own ops), so the map is what
the model did, not a re-computation of it. The command draws the map as a
self-contained HTML page (``PREFIX.html``: bytes as text coloured by segment, a segment's loops and experts on hover)
and a PNG (``PREFIX.png``); :func:`write_card_map` draws the PNG a release's model card shows.

Words as in docs/design.md's glossary: a *segment* is the bytes up to and including a boundary; segment 0 is the
null segment (a learned vector, no bytes) that bytes before the first boundary read; the bytes after the last
boundary form the *open* segment, which the recurrent block does not run (it is closed by a later byte).
"""

from __future__ import annotations

import argparse
import codecs
import html
import json
import time
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

#: Byte-level encoding (tokenization_spider.py): BOS, then byte ``b`` as id ``b``.
BOS_ID = 257
#: Background colours cycled over segments (neighbours always differ); the open segment is grey.
PALETTE = ("#ffd8a8", "#a5d8ff", "#b2f2bb", "#fcc2d7", "#d0bfff", "#ffec99")
OPEN_COLOUR = "#dee2e6"
#: The name of the map a release's model card shows (:func:`write_card_map`).
CARD_MAP_NAME = "compute_map.png"


@dataclass
class ComputeMap:
    """What one forward of Spider did with a batch of `B` rows of `L` ids, `S` the most closed segments of any row,
    `T` the loops run, `R` the recurrent layers, `k` the experts per segment.

    Attributes:
        input_ids: int64 `(B, L)`, the ids mapped (CPU).
        byte_mask: bool `(B, L)`, True for real bytes (False for padding).
        boundary_probs: fp32 `(B, L)`, the boundary predictor's probability per byte.
        boundaries: bool `(B, L)`, the hard decision: True where a byte closes its segment.
        segment_ids: int64 `(B, L)`, the segment holding each byte (the one its state is pooled into): `1..n` for
            the `n` closed segments of the row, `n + 1` for the open segment after the last boundary, -1 for padding.
        read_segment_ids: int64 `(B, L)`, the segment whose recurrent output each byte reads: the last segment closed
            at or before it (0, the null segment, before the first boundary), -1 for padding.
        segment_mask: bool `(B, 1+S)`, True for the row's real segments (the null segment and its closed segments).
        halting_step: int64 `(B, 1+S)`, the loops ACT ran per segment (0 for padding slots).
        loop_weights: fp32 `(B, 1+S, T)`, each loop's ACT weight in the segment's output (a real segment's sum to 1;
            0 from its halting step on).
        experts: int64 `(B, 1+S, T, R, k)`, the routed experts per segment, loop and layer, best first; -1 where the
            MoE did not route the segment (a padding slot; with ``act_early_exit``, a segment that had halted).
        expert_weights: fp32 `(B, 1+S, T, R, k)`, their gate weights (0 where not routed).
    """

    input_ids: torch.Tensor
    byte_mask: torch.Tensor
    boundary_probs: torch.Tensor
    boundaries: torch.Tensor
    segment_ids: torch.Tensor
    read_segment_ids: torch.Tensor
    segment_mask: torch.Tensor
    halting_step: torch.Tensor
    loop_weights: torch.Tensor
    experts: torch.Tensor
    expert_weights: torch.Tensor

    @property
    def closed_segments(self) -> torch.Tensor:
        """int64 `(B,)`: the closed segments of each row (the null segment not counted)."""
        return self.segment_mask.sum(dim=1) - 1


# ---------------------------------------------------------------------------------------------------------------------
# The map: what one forward returns
# ---------------------------------------------------------------------------------------------------------------------


def compute_map(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, n_loops: int | None = None
) -> ComputeMap:
    """The :class:`ComputeMap` of one eval-mode forward of `model` (a ``SpiderForConditionalGeneration`` or its
    ``SpiderModel``) on `input_ids` int64 `(B, L)` with `attention_mask` `(B, L)` (1 real, 0 padding; None: all real)
    and `n_loops` (default ``config.n_loops``). The map is what that call returns with ``output_router_logits=True``
    (which routes the real segments exactly, no padding slots): boundaries, ACT steps and loop weights, and the router
    logits per (loop, layer); the model is put back in its former mode.

    Raises:
        TypeError: `input_ids` is not a tensor of integer ids.
        ValueError: as the model's own input checks (shape, ids outside the vocabulary, too long, bad `n_loops`).
        RuntimeError: the MoE routed a number of rows the map cannot place (the model's routing changed).
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor (batch, length), got {type(input_ids).__name__}")
    base = getattr(model, "model", model)
    layers = base.recurrent_block.layers
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = base(
                input_ids, attention_mask=attention_mask, n_loops=n_loops, use_cache=False, output_router_logits=True
            )
    finally:
        model.train(was_training)
    # the router logits come per loop, then per recurrent layer: (loop, layer) -> (that layer's MoE, logits)
    router = {
        divmod(n, len(layers)): (layers[n % len(layers)].mlp, logits) for n, logits in enumerate(out.router_logits)
    }
    return _assemble(input_ids, attention_mask, out, router, len(layers), layers[0].mlp.top_k)


def _assemble(input_ids, attention_mask, out, router, num_layers: int, top_k: int) -> ComputeMap:
    """The :class:`ComputeMap` from the forward's output `out` and its `router` logits per (loop, layer)."""
    boundaries = out.boundaries.detach() > 0.5
    B, L = boundaries.shape
    byte_mask = torch.ones(B, L, dtype=torch.bool) if attention_mask is None else attention_mask.detach().cpu().bool()
    boundaries = boundaries.cpu() & byte_mask
    closed_so_far = boundaries.long().cumsum(dim=1)
    segment_ids = torch.where(byte_mask, closed_so_far - boundaries.long() + 1, -1)
    read_segment_ids = torch.where(byte_mask, closed_so_far, -1)
    segment_mask = out.segment_mask.detach().cpu() > 0.5
    halting_step = torch.where(segment_mask, out.halting_step.detach().cpu().round().long(), 0)
    loop_weights = out.loop_weights.cpu().to(torch.float32)
    experts, expert_weights = _routed_experts(
        router, segment_mask, halting_step, loop_weights.shape[-1], num_layers, top_k
    )
    return ComputeMap(
        input_ids=input_ids.detach().cpu(),
        byte_mask=byte_mask,
        boundary_probs=out.boundary_probs.detach().cpu().to(torch.float32),
        boundaries=boundaries,
        segment_ids=segment_ids,
        read_segment_ids=read_segment_ids,
        segment_mask=segment_mask,
        halting_step=halting_step,
        loop_weights=loop_weights * segment_mask[..., None],
        experts=experts,
        expert_weights=expert_weights,
    )


def _routed_experts(router, segment_mask, halting_step, loops: int, num_layers: int, k: int):
    """Top-k experts and weights `(B, 1+S, T, R, k)` from the forward's router logits, by the MoE's own ops (its
    ``kernels.topk_gate`` and ``normalize_weight`` as ``SpiderMoE.forward`` calls them). The routed rows are the
    real segments in flattened `(B * (1+S))` order; with ACT early exit, those still running at that loop."""
    B, S1 = segment_mask.shape
    experts = torch.full((B * S1, loops, num_layers, k), -1, dtype=torch.long)
    expert_weights = torch.zeros(B * S1, loops, num_layers, k, dtype=torch.float32)
    for (t, i), (mlp, logits) in router.items():
        scores = logits.to(torch.float32).softmax(dim=-1)
        idx = mlp.kernels.topk_gate(scores, mlp.top_k)
        w = scores.gather(1, idx)
        if mlp.config.norm_topk_prob:
            w = mlp.kernels.normalize_weight(w)[1]
        rows = _routed_rows(segment_mask, halting_step, t, logits.shape[0])
        experts[rows, t, i] = idx.cpu()
        expert_weights[rows, t, i] = w.cpu().to(torch.float32)
    return experts.view(B, S1, loops, num_layers, k), expert_weights.view(B, S1, loops, num_layers, k)


def _routed_rows(segment_mask, halting_step, loop: int, n_rows: int) -> torch.Tensor:
    """Flat indices of the `n_rows` segments the MoE routed at `loop`: every real segment, or (ACT early exit) those
    that had not halted before it. Raises ``RuntimeError`` when neither has `n_rows` rows."""
    real = segment_mask.reshape(-1)
    for rows in (real, real & (halting_step.reshape(-1) > loop)):
        if int(rows.sum()) == n_rows:
            return rows.nonzero().squeeze(1)
    raise RuntimeError(
        f"the MoE routed {n_rows} segments at loop {loop}, but the batch has {int(real.sum())} real "
        "segments: the model routes rows in a way this map does not know"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Segments of one row, as text
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Segment:
    """One segment of a row, for drawing: `index` (0 the null segment, -1 the open segment), its `text` (the characters
    whose last byte is in it; ``"∅"`` for the null segment), its `bytes` range `[start, end)`, the closing byte's
    boundary probability `prob` (None: the null segment or the open segment), `loops`, `weights` (per loop) and
    `experts` (per loop, per layer, `[(expert, weight), ...]`)."""

    index: int
    text: str
    start: int
    end: int
    prob: float | None
    loops: int
    weights: list[float]
    experts: list[list[list[tuple[int, float]]]]


def row_segments(cmap: ComputeMap, row: int = 0) -> list[Segment]:
    """The segments of `row` of `cmap` in reading order: the null segment, the closed segments, the open segment (if
    any bytes follow the last boundary). The bytes are decoded as one UTF-8 stream (``errors="replace"``), each
    character given to the segment holding its last byte, so a character split by a boundary still shows whole.
    Reserved ids (BOS, ...) show as ``⟨s⟩`` / ``⟨id⟩``."""
    ids = cmap.input_ids[row].tolist()
    seg_of = cmap.segment_ids[row].tolist()
    n_closed = int(cmap.closed_segments[row])
    texts = [[] for _ in range(n_closed + 2)]
    spans = [[None, None] for _ in range(n_closed + 2)]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    last = 0
    for position, (token, segment) in enumerate(zip(ids, seg_of)):
        if segment < 0:
            continue
        last = segment
        spans[segment][0] = position if spans[segment][0] is None else spans[segment][0]
        spans[segment][1] = position + 1
        if token < 256:
            texts[segment].append(decoder.decode(bytes([token])))
        else:
            marker = "⟨s⟩" if token == BOS_ID else f"⟨{token}⟩"
            texts[segment].append(decoder.decode(b"", final=True) + marker)
    texts[last].append(decoder.decode(b"", final=True))  # an unfinished character at the end
    probs = cmap.boundary_probs[row].tolist()
    segments = []
    for s in range(n_closed + 2):
        if s == n_closed + 1 and spans[s][0] is None:
            break  # no open segment
        start, end = spans[s] if spans[s][0] is not None else (0, 0)
        closed = 0 < s <= n_closed
        segments.append(
            Segment(
                index=s if s <= n_closed else -1,
                text="∅" if s == 0 else "".join(texts[s]),
                start=start,
                end=end,
                prob=probs[end - 1] if closed else None,
                loops=int(cmap.halting_step[row, s]) if s <= n_closed else 0,
                weights=cmap.loop_weights[row, s].tolist() if s <= n_closed else [],
                experts=_segment_experts(cmap, row, s) if s <= n_closed else [],
            )
        )
    return segments


def _segment_experts(cmap: ComputeMap, row: int, segment: int) -> list:
    ids, weights = cmap.experts[row, segment].tolist(), cmap.expert_weights[row, segment].tolist()
    return [
        [
            [(e, w) for e, w in zip(layer_ids, layer_weights) if e >= 0]
            for layer_ids, layer_weights in zip(loop_ids, loop_weights)
        ]
        for loop_ids, loop_weights in zip(ids, weights)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Drawing: HTML and PNG
# ---------------------------------------------------------------------------------------------------------------------

_HTML_STYLE = """body{font:15px/1.9 ui-monospace,Menlo,Consolas,'DejaVu Sans Mono',monospace;margin:24px;color:#222}
#t{white-space:pre-wrap;word-break:break-all}#t span{border-radius:2px;padding:1px 0;cursor:default}
#t span:hover{outline:2px solid #222}#t .n{color:#888}#t .o{background:%s}
%s
#tip{position:fixed;display:none;background:#fff;border:1px solid #999;padding:6px 9px;font-size:12px;line-height:1.4;
max-width:560px;box-shadow:2px 2px 6px #0003;white-space:pre}h1{font-size:17px}p.k{font-size:12px;color:#555}"""

_HTML_SCRIPT = """const D=__DATA__;const tip=document.getElementById('tip');
function info(i){if(i<0)return 'open segment: not closed yet, so not run (its bytes read the previous segment)';
const s=D.s[i],p=x=>(x/100).toFixed(2);let r='segment '+i+(i?'  positions '+s[0]+'-'+(s[1]-1)+'  boundary p='+p(s[2])
:'  (null segment)')+'\\nACT loops: '+s[3]+'   weights: '+s[4].map(p).join(' ');
s[5].forEach((loop,t)=>{r+='\\nloop '+(t+1)+': '+loop.map((l,j)=>'L'+j+' '+l.map((e,n)=>n%2?p(e):'e'+e).join(' ')
.replace(/(\\d) e/g,'$1, e')).join(' | ')});
return r}
document.getElementById('t').addEventListener('mouseover',e=>{const i=e.target.dataset.i;if(i===undefined)return;
tip.textContent=info(+i);tip.style.display='block'});
document.getElementById('t').addEventListener('mouseout',()=>{tip.style.display='none'});
document.addEventListener('mousemove',e=>{tip.style.left=Math.min(e.clientX+14,innerWidth-580)+'px';
tip.style.top=(e.clientY+18)+'px'});"""


def render_html(cmap: ComputeMap, title: str = "Spider compute map", row: int = 0) -> str:
    """A self-contained HTML page (inline CSS and JS, nothing fetched) of `row` of `cmap`: the text, each segment a
    ``<span class="cN">`` with `N` cycling over :data:`PALETTE` (``o`` for the open segment), thicker underlined
    the more loops it ran; hovering a segment shows its bytes, boundary probability, loops, loop weights and the
    experts of every loop and layer."""
    segments = row_segments(cmap, row)
    data = {"s": {}}
    spans = []
    for seg in segments:
        if seg.index < 0:
            spans.append(f'<span class="o" data-i="-1">{html.escape(seg.text)}</span>')
            continue
        # weights as integer percent, experts as flat [id, percent, id, percent, ...] per layer: a small page
        data["s"][seg.index] = [
            seg.start,
            seg.end,
            -1 if seg.prob is None else round(seg.prob * 100),
            seg.loops,
            [round(w * 100) for w in seg.weights],
            [[[x for e, w in layer for x in (e, round(w * 100))] for layer in loop] for loop in seg.experts],
        ]
        classes = f"c{seg.index % len(PALETTE)} l{min(seg.loops, 8)}" + (" n" if seg.index == 0 else "")
        spans.append(f'<span class="{classes}" data-i="{seg.index}">{html.escape(seg.text)}</span>')
    colours = "".join(f"#t .c{i}{{background:{c}}}" for i, c in enumerate(PALETTE))
    colours += "".join(f"#t .l{n}{{box-shadow:inset 0 -{n}px #0006}}" for n in range(1, 9))
    n_closed = int(cmap.closed_segments[row])
    real = int(cmap.byte_mask[row].sum())
    mean_loops = cmap.halting_step[row, 1 : n_closed + 1].float().mean().item() if n_closed else 0.0
    key = (
        f"{real} ids, {n_closed} closed segments ({real / max(n_closed, 1):.2f} ids per segment), "
        f"{mean_loops:.2f} ACT loops per segment on average. Colours tell neighbouring segments apart; the "
        "underline grows with the loops a segment ran; grey bytes are the open segment; hover for details."
    )
    script = _HTML_SCRIPT.replace("__DATA__", json.dumps(data, separators=(",", ":")))
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>"
        + html.escape(title)
        + "</title><style>"
        + _HTML_STYLE % (OPEN_COLOUR, colours)
        + "</style></head><body><h1>"
        + html.escape(title)
        + "</h1><p class='k'>"
        + html.escape(key)
        + "</p><div id='t'>"
        + "".join(spans)
        + "</div><div id='tip'></div><script>"
        + script
        + "</script></body></html>"
    )


def _cells(text: str) -> int:
    """Monospace cells `text` takes (East Asian wide and full-width characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _layout(segments: list[Segment], width: int) -> list[list[tuple[int, str]]]:
    """Lines of at most `width` cells, each a list of `(segment position in segments, text)` runs."""
    lines, line, used = [], [], 0
    for position, seg in enumerate(segments):
        for char in seg.text.replace("\t", " ").replace("\r", ""):
            if char == "\n" or used >= width:
                lines.append(line)
                line, used = [], 0
                if char == "\n":
                    continue
            char = char if char.isprintable() else "·"
            if line and line[-1][0] == position:
                line[-1] = (position, line[-1][1] + char)
            else:
                line.append((position, char))
            used += _cells(char)
    return lines + [line] if line else lines


def render_png(
    cmap: ComputeMap, path: str | Path, title: str = "Spider compute map", row: int = 0, width: int = 100
) -> Path:
    """Draw `row` of `cmap` into the PNG `path` (matplotlib, Agg): the text in lines of `width` monospace cells on
    its segments' colours, then the ACT loops of every closed segment as bars in the same colours.
    Characters the installed fonts lack (CJK without a CJK font) are drawn as boxes. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    segments = row_segments(cmap, row)
    lines = _layout(segments, width)
    font, cell_w, cell_h = 9.0, 9.0 * 0.602 / 72, 9.0 * 1.5 / 72  # DejaVu Sans Mono advance, inches
    text_h = max(len(lines), 1) * cell_h
    left = 0.7  # inches, room for the bar chart's labels
    fig = plt.figure(figsize=(width * cell_w + left + 0.3, text_h + 2.2), dpi=110)
    ax = fig.add_axes(
        (
            left / fig.get_figwidth(),
            1.7 / fig.get_figheight(),
            width * cell_w / fig.get_figwidth(),
            text_h / fig.get_figheight(),
        )
    )
    ax.set_xlim(0, width)
    ax.set_ylim(max(len(lines), 1), 0)
    ax.axis("off")
    boxes, colours = [], []
    for y, line in enumerate(lines):
        x = 0
        for position, text in line:
            seg = segments[position]
            boxes.append(Rectangle((x, y + 0.08), _cells(text), 0.84))
            colours.append(OPEN_COLOUR if seg.index < 0 else PALETTE[seg.index % len(PALETTE)])
            x += _cells(text)
        ax.text(0, y + 0.5, "".join(t for _, t in line), fontsize=font, family="DejaVu Sans Mono", va="center")
    ax.add_collection(PatchCollection(boxes, facecolors=colours, edgecolors="none", zorder=0))
    ax.set_title(title, fontsize=10, loc="left")

    bars = fig.add_axes(
        (
            left / fig.get_figwidth(),
            0.35 / fig.get_figheight(),
            width * cell_w / fig.get_figwidth(),
            1.0 / fig.get_figheight(),
        )
    )
    closed = [s for s in segments if s.index > 0]
    bars.bar(
        [s.index for s in closed],
        [s.loops for s in closed],
        width=1.0,
        color=[PALETTE[s.index % len(PALETTE)] for s in closed],
    )
    bars.set_xlim(0.5, max(len(closed), 1) + 0.5)
    bars.set_ylim(0, max([s.loops for s in closed], default=1) + 0.5)
    bars.set_xlabel("segment", fontsize=8)
    bars.set_ylabel("ACT loops", fontsize=8)
    bars.tick_params(labelsize=7)
    path = Path(path)
    with warnings.catch_warnings():  # characters the installed fonts lack are drawn as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Loading a release, the command, the model card's map
# ---------------------------------------------------------------------------------------------------------------------


def encode(text: str | bytes, model) -> torch.Tensor:
    """`text` (a str, UTF-8 encoded, or raw bytes) as Spider's ids int64 `(1, 1 + n)` on the model's device: BOS,
    then byte `b` as id `b` (SpiderTokenizer's encoding without EOS). Raises ``ValueError`` for an empty text or
    one longer than the model's ``max_position_embeddings`` (BOS included)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not data:
        raise ValueError("the text is empty: give at least one character to map")
    limit = model.config.max_position_embeddings
    if len(data) + 1 > limit:
        raise ValueError(
            f"the text is {len(data)} bytes; this model reads at most {limit - 1} (max_position_embeddings"
            f"={limit}, BOS included): map a shorter text"
        )
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else BOS_ID
    return torch.tensor([[bos, *data]], dtype=torch.long, device=model.device)


def load_release(release: str | Path):
    """``AutoModelForCausalLM.from_pretrained(release, trust_remote_code=True)`` in eval mode. Raises
    ``FileNotFoundError`` naming `release` when it is neither a folder holding a ``config.json`` nor loadable."""
    from transformers import AutoModelForCausalLM

    folder = Path(release)
    if folder.exists() and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{release} is not a Spider release: it holds no config.json")
    try:
        return AutoModelForCausalLM.from_pretrained(str(release), trust_remote_code=True).eval()
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load the release {release!r}: no such folder, and not a Hub model id that could be loaded ({err})"
        ) from err


def write_map(
    model, text: str | bytes, prefix: str | Path, n_loops: int | None = None, title: str | None = None
) -> tuple[Path, Path]:
    """Map `text` through `model` and write ``PREFIX.html`` and ``PREFIX.png``; returns their paths. Raises as
    :func:`encode` and :func:`compute_map`."""
    cmap = compute_map(model, encode(text, model), n_loops=n_loops)
    loops = n_loops or model.config.n_loops
    title = title or f"Spider compute map ({loops} loops at most)"
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    page = prefix.with_name(prefix.name + ".html")
    page.write_text(render_html(cmap, title), encoding="utf-8")
    return page, render_png(cmap, prefix.with_name(prefix.name + ".png"), title)


def write_card_map(release_folder: str | Path, text: str, model=None, n_loops: int | None = None) -> Path:
    """Draw the map of `text` (a held-out paragraph) into ``release_folder/compute_map.png`` (:data:`CARD_MAP_NAME`),
    for the model card. `model`: the released model (default: loaded from `release_folder`). Returns the path.
    Raises ``FileNotFoundError`` for a missing folder and as :func:`encode`."""
    folder = Path(release_folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"release folder does not exist: {folder}")
    model = load_release(folder) if model is None else model
    cmap = compute_map(model, encode(text, model), n_loops=n_loops)
    return render_png(cmap, folder / CARD_MAP_NAME, "Where Spider spends its compute on a held-out paragraph")


def held_out_paragraph(eval_dataset, max_bytes: int = 600) -> str | None:
    """A paragraph of held-out text for the model card's map: the first paragraph of at least 200 bytes in the first
    example of `eval_dataset` (a dataset of ``{"input_ids": ...}`` byte windows, map-style or iterable; reserved ids
    dropped), else that example's text, cut at a space to at most `max_bytes` bytes. None when the dataset is None
    or empty."""
    if eval_dataset is None:
        return None
    try:
        first = eval_dataset[0] if hasattr(eval_dataset, "__getitem__") else next(iter(eval_dataset))
    except (IndexError, StopIteration):
        return None
    data = bytes(int(i) for i in first["input_ids"] if int(i) < 256)
    text = data.decode("utf-8", errors="ignore").strip()
    paragraphs = [p.strip() for p in text.split("\n\n")]
    text = next((p for p in paragraphs if len(p.encode()) >= 200), text)
    if len(text.encode()) > max_bytes:
        text = text.encode()[:max_bytes].decode("utf-8", errors="ignore")
        text = text.rsplit(" ", 1)[0] if " " in text else text
    return text or None


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """The command: parse `argv`, load the release, write the HTML and the PNG, print their paths and the time."""
    parser = argparse.ArgumentParser(
        prog="python -m spider_training.commands.compute_map", description=__doc__.split("\n")[0]
    )
    parser.add_argument("release", help="a release folder (or Hub model id) that from_pretrained loads")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to map")
    source.add_argument("--file", type=Path, help="a file whose bytes to map")
    parser.add_argument("--n_loops", type=int, default=None, help="recurrent loops (default: the config's n_loops)")
    parser.add_argument("--out", default="compute_map", help="output prefix: PREFIX.html and PREFIX.png")
    args = parser.parse_args(argv)
    if args.file is not None and not args.file.is_file():
        parser.error(f"--file {args.file}: no such file")
    text = args.file.read_bytes() if args.file is not None else args.text
    if not text:
        parser.error("the text to map is empty" + (f" ({args.file} holds no bytes)" if args.file else ""))
    try:
        model = load_release(args.release)
    except FileNotFoundError as err:
        parser.error(str(err))
    start = time.perf_counter()
    try:
        page, picture = write_map(model, text, args.out, args.n_loops)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {page} and {picture} in {time.perf_counter() - start:.2f} s")
    return page, picture


def cli() -> None:
    """``spider-compute-map``: :func:`main` on the command line (what it returns is printed, not the exit status)."""
    main()


if __name__ == "__main__":
    cli()
