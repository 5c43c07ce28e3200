"""Model quality: held-out bits per byte of Spider against a dense byte ``LlamaForCausalLM``, plus ablations.

``python -m bench.quality`` trains each variant with one recipe -- the default run's (batch 16 x 256 bytes, Muon for
the hidden matrices but the routed experts' at peak lr 0.01 and AdamW for the rest at 1e-3, betas (0.9, 0.95), weight
decay 0.1, clipping 1.0, linear warmup then cosine to 0.1x; windows drawn uniformly at random from every pre-2000
address; the ablation and longer-budget rows use the recipe of their day, batch 8 x 256 with Muon for every hidden
matrix (:data:`BATCH8_RECIPE`, the default until 2026-11-25) or AdamW for every parameter, the default before
2026-11-24) -- and scores it on the held-out SOTU addresses from 2000 on (a 32 KB slice
starting a third of the way in, context 256, the slice the quality targets are judged on) and on any ``--text``
file given.

Every row splits its held-out bits per byte by the kind of byte predicted (:data:`BYTE_KINDS`: space or punctuation,
the 1st, 2nd, ... byte of a word). For Spider it also reports bits per byte at 1, half, the trained and twice the
trained loop count, training and evaluation bytes per segment, the mean ACT halting step, and the same weights scored
with the global stream replaced at evaluation (:data:`GLOBAL_STREAM_PROBES`). Every row is one JSON object; ``--out``
writes them all.

Usage::

    python -m bench.quality --runs spider llama              # the headline pair
    python -m bench.quality --runs spider --overrides '{"n_loops": 3}' --name loops3
    python -m bench.quality --runs spider bytes_only --seed 43 --name seed43   # seed noise: the same recipe again
    python -m bench.quality --suite --shard 0/2 --threads 1 --out q0.json   # every row of the results tables (part 1/2)
    python -m bench.quality --suite --only "n_loops=3" "Engram off" --out q.json   # chosen rows only
    python -m bench.quality --time_steps --threads 1   # step times (forward + backward, optimizer) for --step_times

``bench.run_all`` runs :func:`run`: the headline rows (Spider, the same byte layers without the global path, the
dense Llama at equal parameters) judged against the quality targets (:func:`_targets`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from configuration_spider import SpiderConfig  # noqa: E402
from modeling_spider import (  # noqa: E402
    SpiderForConditionalGeneration, attention_mask_function, create_attention_mask, word_bytes,
)
from spider_training.data import encode_document, sotu_documents  # noqa: E402
from spider_training.optim import DEFAULT_MUON_LR, Muon, is_hidden_matrix  # noqa: E402
from tokenization_spider import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE  # noqa: E402

#: the dense baseline: 7 layers, hidden 256, 4 heads, SwiGLU 768 (6.1M parameters, like Spider small)
LLAMA_BASELINE = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=7,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                      pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)


@dataclass
class Recipe:
    """The default run's training recipe (``train_hf.py`` with no arguments; tests/test_bench_quality.py checks that
    they agree)."""

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
    global_lr_scale: float = 1.0  # Spider's global path (everything outside BYTE_LAYERS) at this multiple of lr
    extra_train_loops: int = 0  # Spider: each step's n_loops drawn uniformly from n_loops .. n_loops + this (0: fixed)
    loop_counts: tuple[int, ...] | None = None  # Spider: each step's n_loops drawn uniformly from these (Huginn);
    # overrides extra_train_loops
    same_init: bool = False  # a variant starts the parameters it shares with the default model from its values
    muon_lr: float | None = DEFAULT_MUON_LR  # hidden matrices by torch.optim.Muon at this peak lr, the rest AdamW;
    # None: AdamW for every parameter (the recipe before 2026-11-24, on which the ablation table was measured)
    muon_experts: bool = False  # with muon_lr: the routed MoE experts' matrices (".mlp.experts.") by AdamW, whose step
    # costs a fraction of Muon's Newton-Schulz iterations on their 48 matrices (small preset); True: by Muon too


#: Spider's byte layers, by parameter-name prefix; every other parameter belongs to the global path (boundary
#: predictor, segments, Engram, the recurrent block and its loop machinery, the expanded stream's scale).
BYTE_LAYERS = ("model.embed_tokens.", "model.prelude_layers.", "model.coda_layers.", "model.norm.", "lm_head.")


def param_groups(model, recipe: Recipe, muon: bool = False) -> list[dict]:
    """Parameter groups: weight decay on matrices (`dim >= 2`) only, as the Trainer's default; with
    `recipe.global_lr_scale`, Spider's global path gets its own learning-rate multiplier (H-Net's per-stage
    multipliers, arXiv 2507.07955 §3). Each group carries an ``lr_scale`` applied on top of the schedule. With
    `recipe.muon_lr`, `muon` selects the hidden matrices (:func:`is_hidden_matrix`, for Muon) and
    ``muon=False`` everything else (for AdamW)."""
    is_spider = isinstance(model, SpiderForConditionalGeneration)
    groups = {}
    for name, param in model.named_parameters():
        if recipe.muon_lr is not None and is_hidden_matrix(name, param, experts=recipe.muon_experts) != muon:
            continue
        scale = recipe.global_lr_scale if is_spider and not name.startswith(BYTE_LAYERS) else 1.0
        decay = param.dim() >= 2
        # the fused experts' [gate; up] matrices: gate and up orthogonalised apart (spider_training.optim.Muon)
        blocks = 2 if muon and name.endswith(".mlp.experts.gate_up_proj") else 1
        groups.setdefault((scale, decay, blocks), []).append(param)
    if muon:  # Muon's decoupled decay is lr * weight_decay per step: keep AdamW's per-step decay
        return [{"params": params, "weight_decay": recipe.weight_decay * recipe.lr / recipe.muon_lr,
                 "lr_scale": scale * recipe.muon_lr / recipe.lr, **({"row_blocks": blocks} if blocks > 1 else {})}
                for (scale, _, blocks), params in groups.items()]
    return [{"params": params, "weight_decay": recipe.weight_decay if decay else 0.0, "lr_scale": scale}
            for (scale, decay, _), params in groups.items()]


def optimizers(model, recipe: Recipe) -> list[torch.optim.Optimizer]:
    """AdamW over every parameter, or with `recipe.muon_lr` Muon (:class:`spider_training.optim.Muon`, torch's
    with its bf16 Newton-Schulz products at fp32 speed on CPUs without native bf16; Nesterov momentum 0.95, 5
    Newton-Schulz steps, torch's defaults) over the hidden matrices and AdamW over the rest."""
    opts = [torch.optim.AdamW(param_groups(model, recipe), lr=recipe.lr, betas=recipe.betas)]
    if recipe.muon_lr is not None:
        opts.append(Muon(param_groups(model, recipe, muon=True), lr=recipe.muon_lr))
    return opts


def corpus_bytes(split: str) -> np.ndarray:
    """The SOTU addresses of `split` ("train": before 2000, "eval": 2000 on) as one uint16 id stream
    (BOS + UTF-8 bytes + EOS per address, in year order)."""
    return np.concatenate([encode_document(d["text"]) for d in sotu_documents(split)]).astype(np.int64)


def heldout_windows(ids: np.ndarray, seq_len: int = 256, slice_bytes: int = 32 * 1024, start_fraction: float = 1 / 3
                    ) -> torch.Tensor:
    """Non-overlapping windows of `seq_len + 1` ids from a `slice_bytes` slice starting at `start_fraction` of `ids`:
    int64 `(N, seq_len + 1)`; each window predicts its last `seq_len` ids from the ones before (context <= seq_len)."""
    start = int(len(ids) * start_fraction) if len(ids) > slice_bytes else 0
    piece = ids[start : start + slice_bytes]
    n = (len(piece) - 1) // seq_len
    windows = [piece[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    return torch.from_numpy(np.stack(windows))


def text_file_ids(path: str) -> np.ndarray:
    return encode_document(Path(path).read_text(encoding="utf-8", errors="replace")).astype(np.int64)


#: What a predicted byte is, by its place in the text (SpaceByte's word bytes, :func:`modeling_spider.word_bytes`):
#: the keys of :func:`score`'s ``bits_per_byte_by_byte_kind``, in the order of :func:`byte_kinds`' indices.
BYTE_KINDS = ("space or punctuation", "1st byte of a word", "2nd byte of a word", "3rd byte of a word",
              "4th byte of a word", "5th byte of a word or later")


def byte_kinds(windows: torch.Tensor) -> torch.LongTensor:
    """The kind (:data:`BYTE_KINDS` index) of every predicted byte of `windows` `(N, T)` int64: `(N, T - 1)` int64
    for `windows[:, 1:]`. 0: not a word byte; k >= 1: the k-th byte of its word (5 and later share index 5). The first
    word of a window counts from the window's start (its earlier bytes are not in the window)."""
    word = word_bytes(windows)
    position = torch.arange(windows.shape[1], device=windows.device).expand_as(windows)
    last_spacelike = torch.where(word, -1, position).cummax(dim=1).values
    return torch.where(word, position - last_spacelike, 0).clamp(max=len(BYTE_KINDS) - 1)[:, 1:]


@torch.no_grad()
def score(model, windows: torch.Tensor, n_loops: int | None = None, batch_size: int = 16,
          by_byte_kind: bool = False) -> dict:
    """Bits per predicted byte of `model` over `windows` `(N, T)`, in eval mode; Spider's bytes per segment too.
    `by_byte_kind`: also ``bits_per_byte_by_byte_kind`` (bits per byte of the bytes of each :data:`BYTE_KINDS` kind)
    and ``byte_kind_shares`` (each kind's share of the predicted bytes)."""
    model.eval()
    device = next(model.parameters()).device  # the windows are built on the CPU; the model may sit on a GPU
    nll, count, seg_bytes, segs = 0.0, 0, 0.0, 0.0
    kinds = byte_kinds(windows) if by_byte_kind else None
    kind_nll = torch.zeros(len(BYTE_KINDS), dtype=torch.float64)
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(device)
        kwargs = {"n_loops": n_loops} if n_loops is not None else {}
        out = model(input_ids=batch, **kwargs)
        logits = out.logits[:, :-1].float()
        flat_logits, targets = logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        nll += F.cross_entropy(flat_logits, targets, reduction="sum").item()
        count += batch[:, 1:].numel()
        if kinds is not None:  # a second, unreduced pass: the sum above keeps the headline bit-identical to rows
            # measured before the split (a sum of the unreduced losses differs in the last bits)
            per_byte = F.cross_entropy(flat_logits, targets, reduction="none").double().cpu()
            kind_nll.index_add_(0, kinds[i : i + batch_size].reshape(-1), per_byte)
        if getattr(out, "compression_rate", None) is not None:
            segs += batch.numel() / float(out.compression_rate)
            seg_bytes += batch.numel()
    result = {"bits_per_byte": nll / count / math.log(2)}
    if segs:
        result["bytes_per_segment"] = seg_bytes / segs
    if kinds is not None:
        counts = torch.bincount(kinds.reshape(-1), minlength=len(BYTE_KINDS)).double()
        bits = kind_nll / counts.clamp_min(1) / math.log(2)
        result["bits_per_byte_by_byte_kind"] = dict(zip(BYTE_KINDS, bits.tolist()))
        result["byte_kind_shares"] = dict(zip(BYTE_KINDS, (counts / counts.sum()).tolist()))
    return result


#: What :class:`_GlobalStreamProbe` hands the bytes instead of the trained global stream, `(B, 1+S, D) -> (B, 1+S, D)`:
#: nothing; the same content-free vector everywhere (the null segment's, segment 0, which the bytes before the first
#: boundary read); or every segment's stream one segment late (each byte reads the segment before its own).
GLOBAL_STREAM_PROBES = {
    "removed": torch.zeros_like,
    "the null segment's for every byte": lambda stream: stream[:, :1].expand_as(stream),
    "one segment late": lambda stream: torch.cat([stream[:, :1], stream[:, :-1]], dim=1),
}


class _GlobalStreamProbe:
    """Context manager: a trained Spider's global stream (``SpiderFlexiTokens.global_stream``, what each segment
    hands back to the bytes) replaced at evaluation by one of :data:`GLOBAL_STREAM_PROBES`, the same weights
    otherwise: how much of the trained model's prediction rests on what the path carries."""

    def __init__(self, model, probe: str):
        self.flexitokens, self.probe = model.model.flexitokens, GLOBAL_STREAM_PROBES[probe]

    def __enter__(self):
        flexitokens, probe, trained = self.flexitokens, self.probe, type(self.flexitokens).global_stream
        flexitokens.global_stream = lambda h_out: probe(trained(flexitokens, h_out))
        return self

    def __exit__(self, *exc):
        del self.flexitokens.global_stream  # back to the class's method


class _BoundaryRule:
    """Context manager: the trained boundary predictor of `model` decides at evaluation by another rule.

    ``"sampled"``: a byte closes a segment with probability ``p`` (a Bernoulli draw, seeded); ``"rate-matched"``: the
    threshold is the quantile of this batch's ``p`` that gives one boundary per `bytes_per_segment` bytes (the training
    run's rate). The default rule (``p > boundary_threshold``) needs no context manager."""

    def __init__(self, model, rule: str, bytes_per_segment: float | None):
        self.predictor = model.model.flexitokens.boundary_predictor
        self.rule, self.bytes_per_segment = rule, bytes_per_segment

    def __enter__(self):
        predictor, rule, rate = self.predictor, self.rule, 1.0 / (self.bytes_per_segment or 1.0)
        generator = torch.Generator().manual_seed(0)

        def decide(hidden_states, token_mask=None, position_ids=None):
            probs = torch.sigmoid(predictor.logits(hidden_states))
            if rule == "sampled":
                boundaries = (torch.rand(probs.shape, generator=generator) < probs).float()
            else:
                real = probs if token_mask is None else probs[token_mask.bool()]
                boundaries = (probs > torch.quantile(real.float(), 1.0 - rate)).float()
            return (boundaries * token_mask if token_mask is not None else boundaries), probs

        predictor.forward = decide
        return self

    def __exit__(self, *exc):
        del self.predictor.forward  # back to the class's forward


def score_with_boundary_rule(model, windows: torch.Tensor, rule: str, train_bytes_per_segment: float | None) -> dict:
    """:func:`score` with the boundary decision at evaluation replaced by `rule` ("sampled" or "rate-matched")."""
    with _BoundaryRule(model, rule, train_bytes_per_segment):
        return score(model, windows)


SAMPLE_PROMPT = "The state of the Union is"


def sample_words(model, train_ids: np.ndarray, n_samples: int = 16, new_bytes: int = 200, temperature: float = 0.8,
                 seed: int = 0) -> dict:
    """Sample `n_samples` continuations of :data:`SAMPLE_PROMPT` (`new_bytes` bytes each, temperature sampling,
    seeded) and measure how many of their words are real: the share of alphabetic words (lower-cased, punctuation
    stripped) that occur in the training addresses. Returns ``{"sample": first continuation (str),
    "real_word_rate": float in [0, 1], "real_word_samples": n_samples}`` (rows before 2026-11-25 used 4 samples, whose
    rate moved by about 0.02 from one sampling seed to the next)."""
    import re

    text = train_ids[train_ids < 256].astype(np.uint8).tobytes().decode("utf-8", "replace")
    vocabulary = set(re.findall(r"[a-z]+", text.lower()))
    prompt = torch.tensor([[BOS_ID, *SAMPLE_PROMPT.encode()]], device=next(model.parameters()).device)
    torch.manual_seed(seed)
    model.eval()
    texts = []
    with torch.no_grad():
        for _ in range(n_samples):
            out = model.generate(prompt, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=new_bytes,
                                 min_new_tokens=new_bytes, pad_token_id=PAD_ID, eos_token_id=None)
            texts.append(bytes(int(i) for i in out[0, prompt.shape[1]:] if i < 256).decode("utf-8", "replace"))
    words = [w for t in texts for w in re.findall(r"[A-Za-z]+", t)]
    real = sum(w.lower() in vocabulary for w in words)
    return {"sample": SAMPLE_PROMPT + texts[0], "real_word_rate": real / max(1, len(words)),
            "real_word_samples": n_samples}


def lr_at(step: int, total: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps))
    return recipe.lr * (recipe.min_lr_rate + (1 - recipe.min_lr_rate) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_loop_counts(model, recipe: Recipe) -> tuple[int, ...] | None:
    """The loop counts a Spider training step draws from (uniformly, one per step): `recipe.loop_counts`, else the
    configured ``n_loops`` up to ``n_loops + recipe.extra_train_loops`` (``train_hf.py --extra_train_loops``'s rule);
    None for a fixed count or another model."""
    if not isinstance(model, SpiderForConditionalGeneration):
        return None
    if recipe.loop_counts:
        return tuple(recipe.loop_counts)
    n = model.config.n_loops
    return tuple(range(n, n + recipe.extra_train_loops + 1)) if recipe.extra_train_loops else None


def train(model, train_ids: np.ndarray, recipe: Recipe, eval_windows: torch.Tensor | None = None) -> dict:
    """Train `model` with `recipe` on windows drawn uniformly at random from `train_ids`; returns training stats."""
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    loop_rng = np.random.default_rng(recipe.seed + 1)  # its own stream: the data order is the default run's
    opts = optimizers(model, recipe)
    model.train()
    T = recipe.seq_len + 1
    device = next(model.parameters()).device  # the windows are drawn on the CPU; the model may sit on a GPU
    loop_counts = training_loop_counts(model, recipe)
    losses, rates, curve = [], [], []
    start = time.perf_counter()
    total = recipe.steps
    for step in range(total):
        lr = lr_at(step, total, recipe)
        for group in (g for opt in opts for g in opt.param_groups):
            group["lr"] = lr * group["lr_scale"]
        offsets = rng.integers(0, len(train_ids) - T, size=recipe.batch_size)
        batch = torch.from_numpy(np.stack([train_ids[o : o + T] for o in offsets])).to(device)
        loops = {"n_loops": int(loop_rng.choice(loop_counts))} if loop_counts else {}
        out = model(input_ids=batch, labels=batch, **loops)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float((out.lm_loss if getattr(out, "lm_loss", None) is not None else out.loss).detach()))
        if getattr(out, "compression_rate", None) is not None:
            rates.append(float(out.compression_rate))
        if recipe.eval_every and eval_windows is not None and (step + 1) % recipe.eval_every == 0:
            paused = time.perf_counter()
            curve.append({"step": step + 1, "seconds": paused - start, **score(model, eval_windows)})
            model.train()
            start += time.perf_counter() - paused  # evaluation time is not training time
    seconds = time.perf_counter() - start
    tail = max(1, len(losses) // 10)
    stats = {"steps": total, "train_seconds": seconds, "train_bits_per_byte": float(np.mean(losses[-tail:])) / math.log(2)}
    if rates:
        stats["train_bytes_per_segment"] = float(np.mean(rates[-tail:]))
    if curve:
        stats["curve"] = curve
    return stats


class BytePathOnly(torch.nn.Module):
    """The "global path removed" ablation: Spider's own byte layers alone -- `embed_tokens -> prelude -> coda ->
    norm -> lm_head` -- with no boundaries, segments, recurrent block or expansion. Same byte layers, same init."""

    def __init__(self, spider: SpiderForConditionalGeneration):
        super().__init__()
        trunk = spider.model
        self.layers = torch.nn.ModuleList([*trunk.prelude_layers, *trunk.coda_layers])
        self.spider_config, self.sliding_window = spider.config, spider.config.sliding_window
        self.embed_tokens, self.rotary_emb, self.norm, self.lm_head = (
            trunk.embed_tokens, trunk.rotary_emb, trunk.norm, spider.lm_head)

    def forward(self, input_ids, labels=None, **_):
        from transformers.modeling_outputs import CausalLMOutput

        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        rope = self.rotary_emb(x, positions)
        mask_function = attention_mask_function(None, self.sliding_window, key_positions=positions)
        mask = create_attention_mask(self.spider_config, x, input_ids.shape[1], mask_function)
        for layer in self.layers:
            x = layer(x, rope, mask)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def build(kind: str, overrides: dict) -> torch.nn.Module:
    """A fresh model of `kind`: ``"spider"`` (the small preset with `overrides`), ``"bytes_only"`` (its byte layers,
    :class:`BytePathOnly`), ``"llama"`` (:data:`LLAMA_BASELINE`) or ``"llama_local"`` (the same dense model with
    Spider's byte-layer window, ``sliding_window`` 4: transformers' ``MistralForCausalLM``, which is Llama with
    sliding-window attention)."""
    if kind == "llama_local":
        from transformers import MistralConfig, MistralForCausalLM

        window = SpiderConfig.from_preset("small").sliding_window
        return MistralForCausalLM(MistralConfig(**{**LLAMA_BASELINE, "sliding_window": window, **overrides}))
    if kind == "bytes_only":
        return BytePathOnly(SpiderForConditionalGeneration(SpiderConfig.from_preset("small", **overrides)))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**{**LLAMA_BASELINE, **overrides}))
    return SpiderForConditionalGeneration(SpiderConfig.from_preset("small", **overrides))


def initial_model(kind: str, overrides: dict, seed: int, same_init: bool = False) -> torch.nn.Module:
    """:func:`build` under `seed`; with `same_init`, a variant's parameters that the model without `overrides` also
    has (same name and shape) take that model's initial values under that seed."""
    torch.manual_seed(seed)
    model = build(kind, overrides)
    if same_init and overrides:
        torch.manual_seed(seed)
        reference = build(kind, {}).state_dict()
        own = model.state_dict()
        model.load_state_dict({k: v for k, v in reference.items() if k in own and own[k].shape == v.shape},
                              strict=False)
    return model


def train_and_score(kind: str, name: str, overrides: dict, recipe: Recipe,
                    extra_texts: dict[str, np.ndarray] | None = None, loops_curve: bool = True, save: str | None = None,
                    slice_bytes: int = 32 * 1024, samples: bool = True) -> dict:
    """Train one variant (`kind` ``"spider"``, ``"bytes_only"`` or ``"llama"``, with Spider config `overrides`) by
    `recipe` and score it on the held-out slice (`slice_bytes` bytes): one row of the docs/results.md tables (a dict of
    floats in bits per byte, bytes per segment, seconds). `save`: a folder for ``save_pretrained``.

    `recipe.same_init`: a variant starts every parameter it shares with the default model (same name and shape) from
    the default model's initial values under the same seed. Without it, a variant that adds or removes a module
    draws every later parameter from another point of the random stream, which is a different seed for the byte
    layers too (seed-to-seed differences are about 0.015 bpb at 500 steps)."""
    same_init = recipe.same_init and bool(overrides)
    model = initial_model(kind, overrides, recipe.seed, same_init)
    train_ids = corpus_bytes("train")
    eval_windows = heldout_windows(corpus_bytes("eval"), recipe.seq_len, slice_bytes=slice_bytes)
    stats = train(model, train_ids, recipe, eval_windows)
    row = {"name": name, "model": kind, "overrides": overrides, "lr": recipe.lr, "seed": recipe.seed,
           **({"same_init": True} if same_init else {}),
           **({"muon_lr": recipe.muon_lr} if recipe.muon_lr is not None else {}),
           "parameters": sum(p.numel() for p in model.parameters()), **stats}
    base = score(model, eval_windows, by_byte_kind=True)
    row["sotu_bits_per_byte"] = base["bits_per_byte"]
    row["bpb_by_byte_kind"], row["byte_kind_shares"] = base["bits_per_byte_by_byte_kind"], base["byte_kind_shares"]
    row["xz_bits_per_byte"] = xz_bits_per_byte(eval_windows)
    if kind == "spider":
        cfg = model.config
        row["n_loops"] = cfg.n_loops
        row["eval_bytes_per_segment"] = base.get("bytes_per_segment")
        if loops_curve:
            counts = sorted({1, max(1, cfg.n_loops // 2), cfg.n_loops, 2 * cfg.n_loops})
            row["bpb_by_loops"] = {str(n): score(model, eval_windows, n_loops=n)["bits_per_byte"] for n in counts}
        with torch.no_grad():
            out = model(input_ids=eval_windows[:16])
        row["mean_halting_step"] = float(out.mean_halting_step)
        # ACT early exit at inference (SpiderConfig.act_early_exit): halted segments skip the remaining loops
        model.config.act_early_exit = True
        with torch.no_grad():
            exit_steps = float(model(input_ids=eval_windows[:16]).mean_halting_step)
        row["act_early_exit"] = {"bits_per_byte": score(model, eval_windows)["bits_per_byte"],
                                 "mean_halting_step": exit_steps, "loops_saved_per_segment": cfg.n_loops - exit_steps}
        model.config.act_early_exit = False
        row["bpb_by_global_stream_probe"] = {}
        for probe in GLOBAL_STREAM_PROBES:
            with _GlobalStreamProbe(model, probe):
                probed = score(model, eval_windows, by_byte_kind=True)
            row["bpb_by_global_stream_probe"][probe] = {"bits_per_byte": probed["bits_per_byte"],
                                                        "by_byte_kind": probed["bits_per_byte_by_byte_kind"]}
        if cfg.boundary_mode != "fixed":
            row["bpb_by_eval_boundary_rule"] = {
                rule: score_with_boundary_rule(model, eval_windows, rule, stats.get("train_bytes_per_segment"))
                for rule in ("sampled", "rate-matched")}
    for label, ids in (extra_texts or {}).items():
        row[f"{label}_bits_per_byte"] = score(model, heldout_windows(ids, recipe.seq_len))["bits_per_byte"]
    if samples and kind in ("spider", "llama"):
        row.update(sample_words(model, train_ids))
    if save and hasattr(model, "save_pretrained"):
        model.save_pretrained(save)
    return row


def run(quick: bool = False, profile: bool | None = None) -> dict:
    """``bench.run_all``'s entry (result format of :mod:`bench.common`): Spider's default run, the same byte layers
    without the global path and the dense Llama at equal parameters and steps, each trained by the default recipe
    (about 35 minutes on one thread), judged against the quality targets. `quick`: 6 steps of 2 x 64 bytes scored
    on a 4 KB slice, which checks the wiring, not the model. The complete tables (every ablation, the equal
    wall-clock sweep, longer budgets) are ``--suite``. `profile` is accepted for the runner and unused."""
    from bench.common import check, finish, info

    start = time.perf_counter()
    recipe = Recipe(steps=6, batch_size=2, seq_len=64, warmup_steps=2) if quick else Recipe()
    size = dict(slice_bytes=4096, samples=False) if quick else {}
    rows = {kind: train_and_score(kind, kind, {}, recipe, loops_curve=kind == "spider", **size)
            for kind in ("spider", "bytes_only", "llama")}
    spider, removed, dense = rows["spider"], rows["bytes_only"], rows["llama"]
    bpb = spider["sotu_bits_per_byte"]
    loops = {int(k): v for k, v in spider["bpb_by_loops"].items()}
    n = spider["n_loops"]
    checks = [
        check("held-out bpb: dense Llama (equal parameters) minus Spider", "bits per byte", 0.0,
              dense["sotu_bits_per_byte"] - bpb),
        check("held-out bpb: global path removed minus Spider", "bits per byte", 0.10,
              removed["sotu_bits_per_byte"] - bpb),
        check("held-out bpb: 1 loop minus the trained count", "bits per byte", 0.0, loops[1] - loops[n]),
        check("held-out bpb: twice the trained loops minus the trained count", "bits per byte", 0.01,
              loops[2 * n] - loops[n], higher_is_better=False),
        check("evaluation vs training bytes per segment", "relative difference", 0.25,
              abs(spider["eval_bytes_per_segment"] / spider["train_bytes_per_segment"] - 1), higher_is_better=False),
    ]
    result = {"benchmark": "quality",
              "description": "held-out bits per byte: Spider, its byte layers alone, a dense Llama (quality targets)",
              "sizes": {"steps": recipe.steps, "batch": recipe.batch_size, "seq_len": recipe.seq_len},
              "dtype": "fp32", "checks": checks,
              "info": [info(f"{kind} held-out bpb", r["sotu_bits_per_byte"], "bits/byte") for kind, r in rows.items()]
              + [info("xz -9e on the slice", spider["xz_bits_per_byte"], "bits/byte")],
              "measurements": rows, "notes": [] if not quick else ["quick: 6 steps, not a model measurement"]}
    return finish(result, start)


#: the dense baseline with Spider's byte-layer window (kind ``"llama_local"``)
LOCAL_DENSE = "dense, 4-byte local attention"

#: The recipe of every row measured before 2026-11-26, when the default run moved to batch 16 x 256 with the MoE
#: experts on AdamW: batch 8 x 256 and Muon for every hidden matrix. :func:`suite_runs` pins it under each ablation and
#: longer-budget row's own recipe changes, so that a rerun reproduces them; the Muon rows among them are compared with
#: :data:`BATCH8_DEFAULT`, the default run of that recipe.
BATCH8_RECIPE = {"batch_size": 8, "muon_experts": True}
BATCH8_DEFAULT = "the default run until 2026-11-25 (batch 8 x 256, Muon for every hidden matrix)"
BATCH8_REMOVED = "global path removed, batch 8 x 256, Muon"
BATCH8_SEED43 = "the default run until 2026-11-25, seed 43 (seed noise)"
BATCH8_REMOVED_SEED43 = "global path removed, batch 8 x 256, seed 43 (seed noise), Muon"
#: The default run's byte layers alone (the "global path removed" row of the headline pair)
DEFAULT_REMOVED = "global path removed (prelude + coda only)"
DEFAULT_REMOVED_SEED43 = "global path removed, seed 43 (seed noise), the default run's recipe"

#: Twice the batch-8 recipe's bytes per step (16 x 256), the same 500 steps: Muon's per-step cost (which grows with the
#: parameters, not the batch) is then spread over twice the data.
LARGER_BATCH = {"batch_size": 16}
LARGER_BATCH_NAME = "the batch-8 default at batch 16 x 256 (twice the bytes per step, Muon for every hidden matrix)"
#: Four times the batch-8 recipe's bytes per step (32 x 256), the same 500 steps: the bytes of the 4x-the-steps run in a
#: quarter of its steps (does the global path need the text, or the optimizer steps?).
LARGEST_BATCH = {"batch_size": 32}
LARGEST_BATCH_NAME = "the batch-8 default at batch 32 x 256 (four times the bytes per step, Muon for every hidden matrix)"

#: The routed MoE experts' matrices trained by AdamW instead of Muon (:func:`is_hidden_matrix`; the default since
#: 2026-11-26): on this CPU a step of the small preset at batch 8 then takes 0.46 s instead of 0.74 s on one thread.
EXPERTS_ON_ADAMW = {"muon_experts": False}
EXPERTS_ON_ADAMW_NAME = "MoE experts on AdamW (Muon for the other hidden matrices)"
#: The default run's recipe spelled out, for rows that change something else in it (their seed)
DEFAULT_RECIPE = {"muon_lr": DEFAULT_MUON_LR, "batch_size": Recipe.batch_size, "muon_experts": Recipe.muon_experts}

#: The recipe the ablations below were measured with: AdamW for every parameter (the default before Muon).
ADAMW = {"muon_lr": None}
#: Each training step's loop count drawn from {n_loops, n_loops + 1} (``train_hf.py --extra_train_loops 1``).
DRAWN_LOOPS = {"extra_train_loops": 1}
DRAWN_LOOPS_NAME = "loop count drawn from {2, 3} each step (extra_train_loops=1)"
#: The AdamW recipe's default run, the reference of every AdamW ablation row.
ADAMW_DEFAULT = "spider, AdamW for every parameter"
#: The segmentation of every row measured before the boundary teacher (2026-11-24): boundaries learned end to end at
#: tk-train.py's 3-byte prior. The AdamW rows, the longer-budget pairs and the Muon learning-rate rows run with it, so that
#: a rerun reproduces them; each is compared with the default run of its own segmentation and optimizer.
END_TO_END_SEGMENTS = {"boundary_teacher": None, "boundary_prior": 0.333}
#: The default run with END_TO_END_SEGMENTS (the default before the teacher), the reference of the Muon rows with it.
END_TO_END_DEFAULT = "boundaries learned end to end (no teacher, prior 0.333: the default before 2026-11-24)"
#: The mixing of every row measured before 2026-11-25: the global stream behind a learned per-channel gate that starts
#: shut (ReZero). Those rows carry it in their overrides, so that a rerun reproduces them.
GATED_MIXING = {"expand_mixing": "scaled_norm"}
#: The default run with GATED_MIXING (the default of 2026-11-24), the row the gate's ablation names.
GATED_DEFAULT = "mixing: a learned gate that starts shut (scaled_norm, ReZero; the default before 2026-11-25)"

#: The ablations of the results table: (name, model kind, Spider config overrides[, Recipe overrides]). Each trains
#: with the batch-8 recipe (:data:`BATCH8_RECIPE`) and AdamW (:data:`ADAMW`; same steps, data, seed), end-to-end
#: boundaries and the gated mixing unless it names another recipe change, and is compared with :data:`ADAMW_DEFAULT`;
#: rows that set ``muon_lr`` are compared with :data:`BATCH8_DEFAULT`, or with :data:`END_TO_END_DEFAULT` when they keep
#: :data:`END_TO_END_SEGMENTS`, and rows of the default run's recipe (:data:`DEFAULT_RECIPE`) with the default run.
ABLATIONS: list[tuple] = [
    (ADAMW_DEFAULT, "spider", {}),
    ("global path removed, AdamW", "bytes_only", {}),
    ("n_loops=1", "spider", {"n_loops": 1}),
    ("n_loops=3", "spider", {"n_loops": 3}),
    ("16-byte window in the byte layers", "spider", {"sliding_window": 16}),
    ("global path removed, 16-byte window", "bytes_only", {"sliding_window": 16}),
    ("global path removed, full attention", "bytes_only", {"sliding_window": None}),
    ("3-byte window in the byte layers", "spider", {"sliding_window": 3}),
    ("global path removed, 3-byte window", "bytes_only", {"sliding_window": 3}),
    ("2-byte window in the byte layers", "spider", {"sliding_window": 2}),
    ("global path removed, 2-byte window", "bytes_only", {"sliding_window": 2}),
    ("2-byte window, segments a fixed stride of 3 bytes", "spider", {"sliding_window": 2, "boundary_mode": "fixed"}),
    ("2-byte window, global stream at scale 0.1 from the start (expand_scale_init=0.1)", "spider",
     {"sliding_window": 2, "expand_scale_init": 0.1}),
    ("global path at 3x the learning rate (H-Net's per-stage multiplier)", "spider", {}, {"global_lr_scale": 3.0}),
    ("loop count drawn from {1, 2, 3} each step (Huginn's randomised recurrence)", "spider", {},
     {"loop_counts": (1, 2, 3)}),
    ("segments of about 5 bytes (boundary_prior 0.2)", "spider", {"boundary_prior": 0.2, "boundary_prior_std": 0.014}),
    ("parameters moved to the global path (byte FFN 384, expert FFN 320)", "spider",
     {"intermediate_size": 384, "moe_intermediate_size": 320}),
    ("dense FFN instead of MoE in the recurrent block", "spider", {"n_routed_experts": 1, "num_experts_per_tok": 1}),
    ("Engram off", "spider", {"engram_layer_ids": []}),
    ("Engram off, every shared parameter from the default's initial values (same_init)", "spider",
     {"engram_layer_ids": []}, {"same_init": True}),
    ("spider, seed 43 (seed noise)", "spider", {}, {"seed": 43}),
    ("global path removed, seed 43 (seed noise)", "bytes_only", {}, {"seed": 43}),
    ("recurrent block attends to the last 2 segments (recurrent_sliding_window=2)", "spider",
     {"recurrent_sliding_window": 2}),
    ("recurrent block attends to the last 4 segments (recurrent_sliding_window=4)", "spider",
     {"recurrent_sliding_window": 4}),
    ("recurrent block attends to the last 8 segments (recurrent_sliding_window=8)", "spider",
     {"recurrent_sliding_window": 8}),
    ("prelude/coda 2 + 2 layers", "spider", {"num_prelude_layers": 2, "num_coda_layers": 2}),
    ("global path removed, prelude/coda 2 + 2 layers", "bytes_only", {"num_prelude_layers": 2, "num_coda_layers": 2}),
    ("mixing: H-Net residual_proj (zero-init byte skip)", "spider", {"expand_mixing": "residual_proj"}),
    ("mixing: expanded + bytes (the seed's)", "spider", {"expand_mixing": "add"}),
    ("ACT with the seed's ponder_loss_coef=0.01", "spider", {"ponder_loss_coef": 0.01}),
    ("MoE balancing loss on (router_aux_loss_coef=0.01, the seed's)", "spider", {"router_aux_loss_coef": 0.01}),
    ("fixed loop count (halting bias -10)", "spider", {"halt_bias_init": -10.0}),
    ("segments: a fixed stride of 3 bytes instead of learned boundaries", "spider", {"boundary_mode": "fixed"}),
    ("boundaries: relaxed Bernoulli in training, threshold at evaluation (the seed's)", "spider",
     {"boundary_mode": "relaxed"}),
    ("the seed's rules together (relaxed boundaries, seed mixing, ponder 0.01, full attention)", "spider",
     {"boundary_mode": "relaxed", "expand_mixing": "add", "ponder_loss_coef": 0.01, "sliding_window": None}),
    (END_TO_END_DEFAULT, "spider", {**END_TO_END_SEGMENTS, **GATED_MIXING}, {"muon_lr": DEFAULT_MUON_LR}),
    ("boundaries learned end to end at the teacher's rate (prior 1/6)", "spider",
     {"boundary_teacher": None, "boundary_prior": 1 / 6}, {"muon_lr": DEFAULT_MUON_LR}),
    ("segments: a fixed stride of 6 bytes instead of the teacher's", "spider",
     {"boundary_mode": "fixed", "boundary_prior": 1 / 6}, {"muon_lr": DEFAULT_MUON_LR}),
    (BATCH8_DEFAULT, "spider", {}, {"muon_lr": DEFAULT_MUON_LR}),
    (BATCH8_REMOVED, "bytes_only", {}, {"muon_lr": DEFAULT_MUON_LR}),
    ("dense Llama (equal parameters), batch 8 x 256", "llama", {}, {"muon_lr": DEFAULT_MUON_LR}),
    (BATCH8_SEED43, "spider", {}, {"muon_lr": DEFAULT_MUON_LR, "seed": 43}),
    (DRAWN_LOOPS_NAME, "spider", {}, {"muon_lr": DEFAULT_MUON_LR, **DRAWN_LOOPS}),
    (f"{DRAWN_LOOPS_NAME}, seed 43", "spider", {}, {"muon_lr": DEFAULT_MUON_LR, "seed": 43, **DRAWN_LOOPS}),
    (BATCH8_REMOVED_SEED43, "bytes_only", {}, {"muon_lr": DEFAULT_MUON_LR, "seed": 43}),
    (GATED_DEFAULT, "spider", GATED_MIXING, {"muon_lr": DEFAULT_MUON_LR}),
    (f"{GATED_DEFAULT}, seed 43", "spider", GATED_MIXING, {"muon_lr": DEFAULT_MUON_LR, "seed": 43}),
    ("global stream at 0.25 of the bytes' RMS (expand_rms_ratio=0.25)", "spider", {"expand_rms_ratio": 0.25},
     {"muon_lr": DEFAULT_MUON_LR}),
    ("global stream at the bytes' RMS (expand_rms_ratio=1)", "spider", {"expand_rms_ratio": 1.0},
     {"muon_lr": DEFAULT_MUON_LR}),
    ("n_loops=1, Muon", "spider", {"n_loops": 1}, {"muon_lr": DEFAULT_MUON_LR}),
    ("n_loops=3, Muon", "spider", {"n_loops": 3}, {"muon_lr": DEFAULT_MUON_LR}),
    ("global path at 3x the learning rate, Muon", "spider", {}, {"muon_lr": DEFAULT_MUON_LR, "global_lr_scale": 3.0}),
    ("global path at 0.5x the learning rate, Muon", "spider", {},
     {"muon_lr": DEFAULT_MUON_LR, "global_lr_scale": 0.5}),
    ("a second coda layer (num_coda_layers=2), Muon", "spider", {"num_coda_layers": 2}, {"muon_lr": DEFAULT_MUON_LR}),
    ("global path removed, a second coda layer, Muon", "bytes_only", {"num_coda_layers": 2},
     {"muon_lr": DEFAULT_MUON_LR}),
    ("Engram over byte 2-, 3-, 4- and 6-grams (engram_ngram_sizes=[2, 3, 4, 6]), Muon", "spider",
     {"engram_ngram_sizes": [2, 3, 4, 6]}, {"muon_lr": DEFAULT_MUON_LR}),
    ("Engram over byte 2-, 3-, 4- and 6-grams at both recurrent layers, Muon", "spider",
     {"engram_ngram_sizes": [2, 3, 4, 6], "engram_layer_ids": [0, 1]}, {"muon_lr": DEFAULT_MUON_LR}),
    ("3 recurrent layers (num_recurrent_layers=3), Muon", "spider", {"num_recurrent_layers": 3},
     {"muon_lr": DEFAULT_MUON_LR}),
    ("Muon at lr 0.005", "spider", {**END_TO_END_SEGMENTS, **GATED_MIXING}, {"muon_lr": 0.005}),
    ("Muon at lr 0.02", "spider", {**END_TO_END_SEGMENTS, **GATED_MIXING}, {"muon_lr": 0.02}),
    ("Muon at lr 0.05", "spider", {**END_TO_END_SEGMENTS, **GATED_MIXING}, {"muon_lr": 0.05}),
    ("global path removed, Muon at lr 0.02", "bytes_only", {}, {"muon_lr": 0.02}),
    ("dense Llama (equal parameters), Muon at lr 0.02", "llama", {}, {"muon_lr": 0.02}),
    (LARGER_BATCH_NAME, "spider", {}, {"muon_lr": DEFAULT_MUON_LR, **LARGER_BATCH}),
    (LARGEST_BATCH_NAME, "spider", {}, {"muon_lr": DEFAULT_MUON_LR, **LARGEST_BATCH}),
    ("global path removed, batch 32 x 256, Muon", "bytes_only", {}, {"muon_lr": DEFAULT_MUON_LR, **LARGEST_BATCH}),
    (EXPERTS_ON_ADAMW_NAME, "spider", {}, {"muon_lr": DEFAULT_MUON_LR, **EXPERTS_ON_ADAMW}),
    ("the default run, seed 43 (seed noise)", "spider", {}, {**DEFAULT_RECIPE, "seed": 43}),
    (DEFAULT_REMOVED_SEED43, "bytes_only", {}, {**DEFAULT_RECIPE, "seed": 43}),
    (f"{DRAWN_LOOPS_NAME}, the default run's recipe", "spider", {}, {**DEFAULT_RECIPE, **DRAWN_LOOPS}),
    ("a second coda layer (num_coda_layers=2), the default run's recipe", "spider", {"num_coda_layers": 2},
     DEFAULT_RECIPE),
    ("a second coda layer (num_coda_layers=2), the default run's recipe, seed 43", "spider", {"num_coda_layers": 2},
     {**DEFAULT_RECIPE, "seed": 43}),
    ("global path removed, a second coda layer, the default run's recipe", "bytes_only", {"num_coda_layers": 2},
     DEFAULT_RECIPE),
]


#: Budgets (multiples of the default's steps) at which the default recipe (Muon, the teacher's segments, the RMS-matched
#: mixing) is also measured with and without the global path; the AdamW recipe's budgets are 2, 4, 8 and 12.
DEFAULT_RECIPE_BUDGETS = (4, 8)
#: Budgets at which the default recipe is also measured at seed 43 and with :data:`DRAWN_LOOPS` (seeds 42 and 43).
DRAWN_LOOPS_BUDGETS = (4,)

#: (byte layers and budget, Spider row, the same byte layers without the global path): the docs/results.md "what the
#: global path adds" table.
GLOBAL_PATH_PAIRS = [
    ("2-byte window", "2-byte window in the byte layers", "global path removed, 2-byte window"),
    ("2-byte window, segments a fixed stride of 3 bytes", "2-byte window, segments a fixed stride of 3 bytes",
     "global path removed, 2-byte window"),
    ("3-byte window", "3-byte window in the byte layers", "global path removed, 3-byte window"),
    ("4-byte window (AdamW)", ADAMW_DEFAULT, "global path removed, AdamW"),
    ("4-byte window (AdamW), seed 43", "spider, seed 43 (seed noise)", "global path removed, seed 43 (seed noise)"),
    ("16-byte window", "16-byte window in the byte layers", "global path removed, 16-byte window"),
    ("4-byte window, prelude/coda 2 + 2 layers", "prelude/coda 2 + 2 layers",
     "global path removed, prelude/coda 2 + 2 layers"),
    ("4-byte window, Muon but the MoE experts on AdamW, the teacher's word segments, batch 16 x 256 (the default run)",
     "spider", DEFAULT_REMOVED),
    ("4-byte window, Muon but the MoE experts on AdamW, the teacher's word segments, batch 16 x 256, seed 43",
     "the default run, seed 43 (seed noise)", DEFAULT_REMOVED_SEED43),
    ("4-byte window, Muon, the teacher's word segments (the default until 2026-11-25)", BATCH8_DEFAULT,
     BATCH8_REMOVED),
    ("4-byte window, Muon, the teacher's word segments, seed 43", BATCH8_SEED43, BATCH8_REMOVED_SEED43),
    ("4-byte window, Muon, the teacher's word segments, loop count drawn from {2, 3}", DRAWN_LOOPS_NAME,
     BATCH8_REMOVED),
    ("4-byte window, Muon, the teacher's word segments, loop count drawn from {2, 3}, seed 43",
     f"{DRAWN_LOOPS_NAME}, seed 43", BATCH8_REMOVED_SEED43),
    ("4-byte window, Muon, a fixed stride of 6 bytes", "segments: a fixed stride of 6 bytes instead of the teacher's",
     BATCH8_REMOVED),
    ("4-byte window, Muon, the teacher's word segments, the gated mixing (the default before 2026-11-25)",
     GATED_DEFAULT, BATCH8_REMOVED),
    ("4-byte window, Muon, the teacher's word segments, the gated mixing, seed 43", f"{GATED_DEFAULT}, seed 43",
     BATCH8_REMOVED_SEED43),
    ("4-byte window, Muon, the teacher's word segments, prelude/coda 1 + 2 layers",
     "a second coda layer (num_coda_layers=2), Muon", "global path removed, a second coda layer, Muon"),
    ("4-byte window, Muon but the MoE experts on AdamW, the teacher's word segments, batch 16 x 256, prelude/coda 1 + 2 "
     "layers", "a second coda layer (num_coda_layers=2), the default run's recipe",
     "global path removed, a second coda layer, the default run's recipe"),
    ("4-byte window, Muon, the teacher's word segments, 3 recurrent layers",
     "3 recurrent layers (num_recurrent_layers=3), Muon", BATCH8_REMOVED),
    ("4-byte window, Muon, the teacher's word segments, Engram over 2- to 6-grams",
     "Engram over byte 2-, 3-, 4- and 6-grams (engram_ngram_sizes=[2, 3, 4, 6]), Muon",
     BATCH8_REMOVED),
    ("4-byte window, Muon, end-to-end boundaries (the default before 2026-11-24)", END_TO_END_DEFAULT,
     BATCH8_REMOVED),
    ("4-byte window, Muon at lr 0.02, end-to-end boundaries", "Muon at lr 0.02", "global path removed, Muon at lr 0.02"),
    ("4-byte window, Muon, the teacher's word segments, batch 16 x 256", LARGER_BATCH_NAME, DEFAULT_REMOVED),
    ("4-byte window, Muon, the teacher's word segments, batch 32 x 256", LARGEST_BATCH_NAME,
     "global path removed, batch 32 x 256, Muon"),
    ("4-byte window, Muon, the teacher's word segments, 4x the steps", "the default run, 4x the steps",
     "global path removed, 4x the steps, Muon"),
    ("4-byte window, Muon, the teacher's word segments, 4x the steps, loop count drawn from {2, 3}",
     "the default run, 4x the steps, loop count drawn from {2, 3}", "global path removed, 4x the steps, Muon"),
    ("4-byte window, Muon, the teacher's word segments, 8x the steps", "the default run, 8x the steps",
     "global path removed, 8x the steps, Muon"),
    ("4-byte window, 2x the steps", "spider, 2x the steps", "global path removed, 2x the steps"),
    ("4-byte window, 4x the steps", "spider, 4x the steps", "global path removed, 4x the steps"),
    ("4-byte window, 8x the steps", "spider, 8x the steps", "global path removed, 8x the steps"),
    ("4-byte window, 12x the steps", "spider, 12x the steps", "global path removed, 12x the steps"),
]


def technical_text_ids() -> np.ndarray:
    """An unrelated technical English text every CPython ships: the Python reference topics of ``pydoc_data``
    (about 465 KB), as one BOS + bytes + EOS id stream."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return encode_document("\n\n".join(topics[k] for k in sorted(topics))).astype(np.int64)


def step_split(kind: str, overrides: dict, recipe: Recipe, steps: int = 12, warmup: int = 3) -> dict[str, float]:
    """Median wall-clock of one training step of a fresh model and of its two parts, in seconds:
    ``{"step": ..., "forward_backward": ..., "optimizer": ...}`` (the optimizer part: the recipe's :func:`optimizers`
    stepping and zeroing; for Muon its Newton-Schulz iterations, whose cost grows with the parameters, not the batch).
    A Spider model runs the loop counts its training draws (:func:`training_loop_counts`) in turn."""
    model = build(kind, overrides)
    opts = optimizers(model, recipe)
    ids = torch.randint(0, 256, (recipe.batch_size, recipe.seq_len + 1))
    counts = training_loop_counts(model, recipe)  # every count in turn: the median is the mean draw's for two counts
    parts = {"step": [], "forward_backward": [], "optimizer": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loops = {"n_loops": counts[i % len(counts)]} if counts else {}
        model(input_ids=ids, labels=ids, **loops).loss.backward()
        t1 = time.perf_counter()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= warmup:
            for key, seconds in (("step", t2 - t0), ("forward_backward", t1 - t0), ("optimizer", t2 - t1)):
                parts[key].append(seconds)
    return {key: float(np.median(v)) for key, v in parts.items()}


def step_seconds(kind: str, overrides: dict, recipe: Recipe, steps: int = 12, warmup: int = 3) -> float:
    """Median wall-clock of one training step (forward, backward, the recipe's :func:`optimizers`) of a fresh model,
    in seconds (:func:`step_split`'s ``"step"``)."""
    return step_split(kind, overrides, recipe, steps, warmup)["step"]


def suite_runs(recipe: Recipe, lrs=(5e-4, 1e-3, 2e-3), step_times: tuple[float, ...] | None = None,
               adamw_step_times: tuple[float, ...] | None = None) -> list[dict]:
    """Every run of the full benchmark, as keyword arguments of :func:`run` (plus a ``group``).

    The default run and its baselines train with the default recipe (batch 16 x 256; Muon for the hidden matrices but
    the routed experts') and again with the AdamW recipe the ablations use (batch 8 x 256, :data:`BATCH8_RECIPE`;
    names and groups end in ", AdamW"). Every ablation and longer-budget row runs with :data:`BATCH8_RECIPE` under its
    own recipe changes. The dense baseline trains at equal
    parameter count (500 steps) and at equal wall-clock: the step count Spider's 500 steps take, from both models'
    measured step times under that recipe (so the comparison does not depend on what else the machine runs while
    training); its learning rates (AdamW's and Muon's together) are swept over `lrs` at equal wall-clock. Spider's
    byte layers alone (the "global path removed" model) also train for Spider's wall-clock: the plain model with the
    same local attention at equal compute.
    `step_times` / `adamw_step_times`: `(Spider, Llama, byte layers alone)` seconds per step under the default / the
    AdamW recipe to use instead of measuring them."""
    adamw = Recipe(**{**recipe.__dict__, **BATCH8_RECIPE, **ADAMW})
    times = {}
    for suffix, rec, given in (("", recipe, step_times), (", AdamW", adamw, adamw_step_times)):
        times[suffix] = given or tuple(step_seconds(kind, {}, rec) for kind in ("spider", "llama", "bytes_only"))
    def segments(kind: str, recipe_overrides: dict, ov: dict) -> dict:  # AdamW rows: the segmentation and mixing
        old = kind == "spider" and recipe_overrides.get("muon_lr", None) is None  # they ran with
        return {**END_TO_END_SEGMENTS, **GATED_MIXING, **ov} if old else ov

    def pinned(recipe_overrides: dict) -> dict:  # the batch-8 recipe under the row's own changes
        return {**BATCH8_RECIPE, **recipe_overrides}

    runs = [dict(group="ablation", kind=kind, name=name, overrides=segments(kind, {**ADAMW, **rov}, ov),
                 steps=recipe.steps, lr=recipe.lr, recipe=pinned({**ADAMW, **rov}), times=", AdamW")
            for name, kind, ov, *recipe_ov in ABLATIONS for rov in [recipe_ov[0] if recipe_ov else {}]]
    runs.insert(0, dict(group="default", kind="spider", name="spider", overrides={}, steps=recipe.steps,
                        lr=recipe.lr, times=""))
    runs.insert(1, dict(group="default", kind="bytes_only", name=DEFAULT_REMOVED,
                        overrides={}, steps=recipe.steps, lr=recipe.lr, times=""))
    for suffix, rec in (("", {}), (", AdamW", pinned(ADAMW))):
        t_spider, t_llama, t_bytes = times[suffix]
        dense_equal_time_steps = max(1, round(recipe.steps * t_spider / t_llama))
        runs.append(dict(group=f"baseline equal parameters{suffix}", kind="llama", name=f"llama{suffix}",
                         overrides={}, steps=recipe.steps, lr=recipe.lr, recipe=rec, times=suffix))
        if not suffix:  # the dense model with Spider's local attention: the same FLOPs as the Llama (its step time),
            # at the learning rate that was the Llama's best at equal wall-clock
            runs.append(dict(group="local baseline equal parameters", kind="llama_local", name=LOCAL_DENSE,
                             overrides={}, steps=recipe.steps, lr=recipe.lr, times=suffix))
            runs.append(dict(group="local baseline equal wall-clock", kind="llama_local",
                             name=f"{LOCAL_DENSE}, equal wall-clock", overrides={},
                             steps=dense_equal_time_steps, lr=2 * recipe.lr,
                             recipe={"muon_lr": 2 * recipe.muon_lr}, times=suffix))
        for lr in lrs:
            muon = rec or {"muon_lr": recipe.muon_lr * lr / recipe.lr}  # Muon's rate moves with AdamW's
            runs.append(dict(group=f"baseline equal wall-clock{suffix}", kind="llama",
                             name=f"llama lr={lr:g}, equal wall-clock{suffix}", overrides={},
                             steps=dense_equal_time_steps, lr=lr, recipe=muon, times=suffix))
        if suffix:  # Spider with AdamW for as long as the default (Muon) run takes: the optimizer at equal compute
            runs.append(dict(group="spider equal wall-clock, AdamW", kind="spider", name="spider, AdamW, equal wall-clock",
                             overrides={}, steps=max(1, round(recipe.steps * times[""][0] / t_spider)), lr=recipe.lr,
                             recipe=rec, times=suffix))
        runs.append(dict(group=f"byte layers equal wall-clock{suffix}", kind="bytes_only",
                         name=f"global path removed, equal wall-clock{suffix}", overrides={},
                         steps=max(1, round(recipe.steps * t_spider / t_bytes)), lr=recipe.lr, recipe=rec,
                         times=suffix))
    for factor in (2, 4, 8, 12):
        for kind, name in (("spider", f"spider, {factor}x the steps"),
                           ("bytes_only", f"global path removed, {factor}x the steps")):
            runs.append(dict(group="longer budget", kind=kind, name=name, overrides=segments(kind, ADAMW, {}),
                             steps=factor * recipe.steps, lr=recipe.lr, recipe=pinned(ADAMW), times=", AdamW"))
    for factor in DEFAULT_RECIPE_BUDGETS:  # what the global path adds with budget, on the default recipe
        for kind, name in (("spider", f"the default run, {factor}x the steps"),
                           ("bytes_only", f"global path removed, {factor}x the steps, Muon")):
            runs.append(dict(group="longer budget", kind=kind, name=name, overrides={}, steps=factor * recipe.steps,
                             lr=recipe.lr, recipe=pinned({}), times=""))
    for factor in DRAWN_LOOPS_BUDGETS:  # does the loop-count draw still cost nothing with budget? (two seeds)
        for name, rec in ((f"the default run, {factor}x the steps, seed 43", {"seed": 43}),
                          (f"the default run, {factor}x the steps, loop count drawn from {{2, 3}}", DRAWN_LOOPS),
                          (f"the default run, {factor}x the steps, loop count drawn from {{2, 3}}, seed 43",
                           {**DRAWN_LOOPS, "seed": 43})):
            runs.append(dict(group="longer budget", kind="spider", name=name, overrides={},
                             steps=factor * recipe.steps, lr=recipe.lr, recipe=pinned(rec), times=""))
    for r in runs:
        r["step_seconds"] = dict(zip(("spider", "llama", "bytes_only"), times[r.pop("times")]))
    return runs


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


def run_suite(shard: int = 0, num_shards: int = 1, texts: dict | None = None, steps: int = Recipe.steps,
              out: str | None = None, log=sys.stderr, only: list[str] | None = None,
              step_times: dict[str, tuple[float, ...]] | None = None) -> list[dict]:
    """Run this shard's part (:func:`shard_of`) of :func:`suite_runs` -- only the rows named in `only`, if given
    (unknown names raise ``ValueError``); one row per run, rewritten to `out` (JSON) after every run. `step_times`:
    ``{"default": (Spider, Llama, bytes), "adamw": (...)}`` seconds per step measured beforehand on an otherwise idle
    machine (``--step_times``), so that shards running side by side share one measurement."""
    base = Recipe(steps=steps)
    if only:  # checked before the step timing, which trains both models for a few steps
        unknown = sorted(set(only) - {r["name"] for r in suite_runs(base, step_times=(1.0, 1.0, 1.0),
                                                                     adamw_step_times=(1.0, 1.0, 1.0))})
        if unknown:
            raise ValueError(f"unknown quality rows {unknown}; see ABLATIONS and suite_runs for the names")
    times = step_times or {}
    runs = [r for r in suite_runs(base, step_times=times.get("default"), adamw_step_times=times.get("adamw"))
            if not only or r["name"] in only]
    rows = []
    for spec in shard_of(runs, shard, num_shards):
        recipe = Recipe(steps=spec["steps"], lr=spec["lr"], warmup_steps=min(200, max(1, spec["steps"] // 10)),
                        eval_every=max(1, base.steps // 10) if spec["name"] in ("spider", "llama") else 0,
                        **spec.get("recipe", {}))
        print(f"[quality] {spec['name']} ...", file=log, flush=True)
        row = train_and_score(spec["kind"], spec["name"], spec["overrides"], recipe, texts,
                              loops_curve=spec["kind"] == "spider")
        row.update(group=spec["group"], step_seconds=spec["step_seconds"])
        if spec.get("recipe"):
            row["recipe"] = spec["recipe"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        if out:
            Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def xz_bits_per_byte(windows: torch.Tensor) -> float:
    """`xz -9e` (LZMA preset 9 | extreme) on the bytes of `windows` (ids >= 256 dropped): compressed bits per byte."""
    import lzma

    ids = torch.cat([windows[0], windows[1:, 1:].reshape(-1)])  # consecutive windows share one id
    raw = bytes(int(i) for i in ids if int(i) < 256)
    return 8 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) / len(raw)


def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def _headline_rows(rows: list[dict], by_name: dict, suffix: str, optimizer: str) -> list[str]:
    """The first table's rows for one recipe: Spider, the dense Llama at equal parameters and at equal wall-clock
    (best of the learning-rate sweep), the byte layers alone at equal wall-clock; `suffix` ends their names."""
    tech = "pydoc_topics_bits_per_byte"
    spider = by_name.get("spider" if not suffix else ADAMW_DEFAULT)
    dense = by_name.get(f"llama{suffix}")
    equal_time = [r for r in rows if r.get("group") == f"baseline equal wall-clock{suffix}"]
    best = min(equal_time, key=lambda r: r["sotu_bits_per_byte"]) if equal_time else None
    lines = []

    def line(label, r, bold=False):
        bpb = f"**{_f(r['sotu_bits_per_byte'])}**" if bold else _f(r["sotu_bits_per_byte"])
        muon_lr = (r.get("recipe") or {}).get("muon_lr")  # a swept row's own Muon rate
        label_optimizer = f"Muon (lr {muon_lr:g}) + AdamW" if muon_lr and not suffix else optimizer
        lines.append(f"| {label} | {label_optimizer} | {r['steps']} | {r['parameters'] / 1e6:.2f}M | {bpb} | "
                     f"{_f(r.get(tech))} |")

    if spider:
        line("Spider `small`" + (" (the default run)" if not suffix else ""), spider, bold=not suffix)
    if dense:
        line(f"`LlamaForCausalLM`, equal parameters and steps (lr {dense['lr']:g})", dense)
    if best:
        sweep = ", ".join(f"{r['lr']:g}: {_f(r['sotu_bits_per_byte'])}" for r in equal_time)
        line(f"`LlamaForCausalLM`, equal wall-clock (best lr {best['lr']:g}; sweep {sweep})", best)
    for group, label in (("local baseline equal parameters", "equal parameters and steps"),
                         ("local baseline equal wall-clock", "equal wall-clock")):
        for r in rows:
            if not suffix and r.get("group") == group:
                line(f"the same dense model with Spider's 4-byte local attention (`MistralForCausalLM`), {label} "
                     f"(lr {r['lr']:g})", r)
    for r in rows:
        if suffix and r.get("group") == f"spider equal wall-clock{suffix}":
            line("Spider `small`, for the default run's wall-clock", r)
    for r in rows:
        if r.get("group") == f"byte layers equal wall-clock{suffix}":
            line("Spider's byte layers alone (global path removed), equal wall-clock", r)
    return lines


def of_default_recipe(row: dict) -> bool:
    """Whether a row trained with the default run's batch size and optimizer split (:data:`DEFAULT_RECIPE`; rows that
    do not record them in their ``recipe`` trained with :data:`BATCH8_RECIPE`)."""
    recipe = {**BATCH8_RECIPE, **(row.get("recipe") or {})}
    return all(recipe[key] == DEFAULT_RECIPE[key] for key in ("batch_size", "muon_experts"))


def render(rows: list[dict]) -> str:
    """The "Model quality" section of docs/results.md (Markdown) from the suite's rows."""
    by_name = {r["name"]: r for r in rows}
    spider = by_name["spider"]
    batch8 = by_name.get(BATCH8_DEFAULT, spider)
    adamw_default = by_name.get(ADAMW_DEFAULT, batch8)
    end_to_end = by_name.get(END_TO_END_DEFAULT, batch8)
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
        *(f"| held-out bpb at n_loops={n}{' (trained)' if int(n) == spider.get('n_loops') else ''} | {_f(v, 4)} |"
          for n, v in loops.items()),
        f"| training bytes per segment | {_f(spider.get('train_bytes_per_segment'), 2)} |",
        f"| evaluation bytes per segment | {_f(spider.get('eval_bytes_per_segment'), 2)} |",
        f"| mean ACT halting step | {_f(spider.get('mean_halting_step'), 2)} |",
        *([f"| with ACT early exit at inference (`act_early_exit=True`): held-out bpb | "
           f"{_f(spider['act_early_exit']['bits_per_byte'], 4)} |",
           f"| with ACT early exit: loops saved per segment (of {spider.get('n_loops')}) | "
           f"{_f(spider['act_early_exit']['loops_saved_per_segment'], 3)} |"] if "act_early_exit" in spider else []),
        "",
        f"| ablation (one change, same budget; batch 8 x 256 unless named; the AdamW recipe and end-to-end boundaries "
        f"unless Muon is named, compared with the AdamW default run of then, {_f(adamw_default['sotu_bits_per_byte'])}; "
        f"Muon rows with end-to-end boundaries with that default under Muon, {_f(end_to_end['sotu_bits_per_byte'])}; "
        f"the other Muon rows with the default run until 2026-11-25, {_f(batch8['sotu_bits_per_byte'])}, and the rows "
        "of today's recipe with the default run) | held-out bpb | vs its default |",
        "|---|---:|---:|",
    ]
    def reference(r: dict) -> dict:  # the default run of the row's own optimizer, batch and segmentation
        if r["name"] == ADAMW_DEFAULT:
            return end_to_end  # the optimizer alone
        if r.get("muon_lr") is None:
            return adamw_default
        if r["name"] == BATCH8_DEFAULT or of_default_recipe(r):
            return spider
        old_segments = (r.get("overrides") or {}).get("boundary_teacher", "spacelike") is None and r["model"] == "spider"
        return end_to_end if old_segments and r["name"] != END_TO_END_DEFAULT else batch8

    for r in rows:
        if r.get("group") == "ablation":
            ref = reference(r)
            delta = r["sotu_bits_per_byte"] - ref["sotu_bits_per_byte"]
            lines.append(f"| {r['name']} | {_f(r['sotu_bits_per_byte'])} | {delta:+.3f} |")
    for rule, result in spider.get("bpb_by_eval_boundary_rule", {}).items():
        delta = result["bits_per_byte"] - spider["sotu_bits_per_byte"]
        lines.append(f"| boundary decision at evaluation: {rule} (same weights; "
                     f"{_f(result.get('bytes_per_segment'), 2)} bytes per segment) | {_f(result['bits_per_byte'])} | "
                     f"{delta:+.3f} |")
    pairs = [(label, by_name[a], by_name[b]) for label, a, b in GLOBAL_PATH_PAIRS if a in by_name and b in by_name]
    if pairs:
        lines += ["", "| what the global path adds: byte layers, budget (batch 8 x 256, AdamW and end-to-end boundaries "
                  "unless named) "
                  "| steps | Spider | "
                  "global path removed | the global path adds |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {label} | {a['steps']} | {_f(a['sotu_bits_per_byte'])} | {_f(b['sotu_bits_per_byte'])} | "
                  f"{b['sotu_bits_per_byte'] - a['sotu_bits_per_byte']:+.3f} |" for label, a, b in pairs]
    lines += _gain_by_byte_kind(spider, by_name)
    lines += ["", *_targets(spider, by_name, best)]
    samples = [(label, r) for label, r in (("Spider", spider), ("Llama (equal parameters)", dense)) if r and "sample" in r]
    if samples:
        lines += ["", "Samples (temperature 0.8, prompt \"The state of the Union is\"; real words = share of the "
                  f"sampled words that occur in the training addresses, over {samples[0][1].get('real_word_samples', 4)} "
                  "200-byte samples):", ""]
        for label, r in samples:
            text = " ".join(r["sample"][:160].split()).replace("`", "'")  # one line of inline code
            lines.append(f"- {label} (real words {r['real_word_rate']:.0%}): `{text}`")
    return "\n".join(lines) + "\n"


#: The default run's row and its byte layers alone, at the default budget and at 4x the steps: the pairs of the
#: "where the global path's gain sits" tables.
DEFAULT_PAIR = ("spider", DEFAULT_REMOVED)
FOUR_X_PAIR = ("the default run, 4x the steps", "global path removed, 4x the steps, Muon")
#: (column label, row name) of the by-kind table, after the default run's column
BYTE_KIND_COLUMNS = [("byte layers alone", DEFAULT_PAIR[1]), ("dense Llama, equal parameters", "llama"),
                     ("Spider, batch 8, 4x the steps", FOUR_X_PAIR[0]),
                     ("byte layers alone, batch 8, 4x the steps", FOUR_X_PAIR[1])]


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
    columns = [(label, by_name[name]) for label, name in BYTE_KIND_COLUMNS if has_kinds(by_name.get(name))]
    gains = [(label, by_name.get(a), by_name.get(b)) for label, (a, b) in
             (("the global path adds", DEFAULT_PAIR), ("the global path adds, batch 8, 4x the steps", FOUR_X_PAIR))]
    gains = [(label, a, b) for label, a, b in gains if has_kinds(a) and has_kinds(b)]
    header = ["byte predicted", "share of the bytes", "Spider (the default run)", *(c for c, _ in columns)]
    header += [label for label, _, _ in gains]
    lines = ["", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for kind in (*BYTE_KINDS, None):
        share = 1.0 if kind is None else spider["byte_kind_shares"][kind]
        cells = [kind or "**every byte**", f"{share:.1%}", _f(_bpb_of_kind(spider, kind)),
                 *(_f(_bpb_of_kind(r, kind)) for _, r in columns),
                 *(f"{_bpb_of_kind(b, kind) - _bpb_of_kind(a, kind):+.3f}" for _, a, b in gains)]
        lines.append("| " + " | ".join(cells) + " |")
    probed = [(label, r) for label, r in (("the default run", spider),
                                          ("batch 8, 4x the steps", by_name.get(FOUR_X_PAIR[0])))
              if r and r.get("bpb_by_global_stream_probe")]
    if probed:
        first = BYTE_KINDS[1]
        header = ["Spider's global stream at evaluation (same weights), held-out bpb against the trained stream's"]
        header += [f"{label}: {part}" for label, _ in probed for part in ("every byte", first)]
        lines += ["", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for probe in (p for p in GLOBAL_STREAM_PROBES if all(p in r["bpb_by_global_stream_probe"] for _, r in probed)):
            cells = [probe]
            for _, r in probed:
                result = r["bpb_by_global_stream_probe"][probe]
                cells += [f"{result['bits_per_byte'] - r['sotu_bits_per_byte']:+.3f}",
                          f"{result['by_byte_kind'][first] - r['bpb_by_byte_kind'][first]:+.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def card_reference(rows: list[dict]) -> dict:
    """What a release card of the default recipe shows next to its own figure (``spider_training.model_card.
    reference_quality``): the default run, the dense baseline at equal parameters and at equal wall-clock (best swept
    learning rate), and the same byte layers without the global path, in held-out bits per byte (3 decimals)."""
    by_name = {r["name"]: r for r in rows}
    spider, llama, bytes_only = by_name["spider"], by_name["llama"], by_name[DEFAULT_REMOVED]
    equal_time = min((r for r in rows if r.get("group") == "baseline equal wall-clock"),
                     key=lambda r: r["sotu_bits_per_byte"])
    millions = lambda r: f"{r['parameters'] / 1e6:.2f}M"  # noqa: E731
    return {
        "preset": "small", "data": "sotu", "steps": spider["steps"],
        "spider_parameters": millions(spider), "spider_bits_per_byte": _f(spider["sotu_bits_per_byte"]),
        "llama_parameters": millions(llama), "llama_bits_per_byte": _f(llama["sotu_bits_per_byte"]),
        "llama_equal_time_bits_per_byte": _f(equal_time["sotu_bits_per_byte"]),
        "bytes_only_parameters": millions(bytes_only), "bytes_only_bits_per_byte": _f(bytes_only["sotu_bits_per_byte"]),
    }


def _targets(spider: dict, by_name: dict, best_equal_time: dict | None) -> list[str]:
    """The quality targets as a table: what was measured and whether it was met."""
    cfg = SpiderConfig.from_preset("small")
    bpb = spider["sotu_bits_per_byte"]
    rows = []

    def target(name, measured, met):
        rows.append(f"| {name} | {measured} | {'yes' if met else '**no**'} |")

    if best_equal_time:
        ref = best_equal_time["sotu_bits_per_byte"]
        target("held-out bpb at or below the dense baseline at equal wall-clock", f"{bpb:.3f} vs {ref:.3f}", bpb <= ref)
        t, tr = spider.get("pydoc_topics_bits_per_byte"), best_equal_time.get("pydoc_topics_bits_per_byte")
        if t is not None and tr is not None:
            target("technical text: no worse than the dense baseline by more than 0.05", f"{t:.3f} vs {tr:.3f}",
                   t <= tr + 0.05)
    xz = spider.get("xz_bits_per_byte")
    if xz is not None:
        target("held-out bpb below `xz -9e`", f"{bpb:.3f} vs {xz:.3f}", bpb < xz)
    removed = by_name.get(DEFAULT_REMOVED)
    if removed:
        gain = removed["sotu_bits_per_byte"] - bpb
        target("the global path pays: removing it costs at least 0.10 bpb", f"{gain:+.3f}", gain >= 0.10)
    loops = {int(k): v for k, v in spider.get("bpb_by_loops", {}).items()}
    n = spider.get("n_loops")
    if n in loops and 1 in loops and 2 * n in loops:
        target("1 loop is worse than the trained count", f"{loops[1]:.4f} vs {loops[n]:.4f}", loops[1] > loops[n])
        target("twice the trained count no worse than it by more than 0.01", f"{loops[2 * n] - loops[n]:+.4f}",
               loops[2 * n] <= loops[n] + 0.01)
    ev, tr = spider.get("eval_bytes_per_segment"), spider.get("train_bytes_per_segment")
    if ev and tr:
        low = cfg.boundary_prior - cfg.boundary_prior_k * cfg.boundary_prior_std
        band = (1 / cfg.boundary_prior, 1 / low)
        target("evaluation bytes per segment within 25% of training's", f"{ev:.2f} vs {tr:.2f}",
               abs(ev / tr - 1) <= 0.25)
        target(f"evaluation bytes per segment inside the prior's band ({band[0]:.2f}-{band[1]:.2f})", f"{ev:.2f}",
               band[0] <= ev <= band[1])
    dense = by_name.get("llama")
    if dense and "real_word_rate" in spider and "real_word_rate" in dense:
        target("samples are real words at least as often as the dense baseline's",
               f"{spider['real_word_rate']:.0%} vs {dense['real_word_rate']:.0%}",
               spider["real_word_rate"] >= dense["real_word_rate"])
    return ["| target | measured | met |", "|---|---|---|", *rows] if rows else []


def plot(rows: list[dict], path: str) -> bool:
    """Held-out bpb against training wall-clock, Spider and the dense baseline: the default runs of each recipe and
    their Llama baselines, where their rows have a ``curve``. Returns False when none has."""
    from matplotlib.figure import Figure

    labels = {"spider": "Spider small (the default run), batch 16, Muon + AdamW",
              BATCH8_DEFAULT: "Spider small, batch 8, Muon + AdamW (until 2026-11-25)",
              ADAMW_DEFAULT: "Spider small, end-to-end boundaries, AdamW",
              END_TO_END_DEFAULT: "Spider small, end-to-end boundaries, Muon + AdamW",
              "llama": "LlamaForCausalLM (equal parameters), batch 16, Muon + AdamW",
              "llama, AdamW": "LlamaForCausalLM (equal parameters), AdamW"}
    curves = [(r["name"], r["curve"]) for r in rows if r.get("curve") and r["name"] in labels]
    if not curves:
        return False
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for name, curve in curves:
        label = labels[name]
        ax.plot([c["seconds"] for c in curve], [c["bits_per_byte"] for c in curve], marker="o", markersize=3,
                label=label)
    ax.set_xlabel("training wall-clock (s, one thread)")
    ax.set_ylabel("held-out bits per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", action="store_true", help="every run of the results tables (see ABLATIONS)")
    parser.add_argument("--shard", default="0/1", help="with --suite: run part K of N (K/N), e.g. 0/2 and 1/2 in "
                        "two processes with --threads 1")
    parser.add_argument("--only", nargs="+", default=None, help="with --suite: only these rows (by name)")
    parser.add_argument("--step_times", default=None,
                        help="with --suite: JSON {\"default\": [spider, llama, bytes_only], \"adamw\": [...]}, seconds "
                        "per step measured on an idle machine (default: measured by each shard)")
    parser.add_argument("--time_steps", action="store_true",
                        help="print the median step time of Spider, the dense Llama and the byte layers alone under "
                        "the default recipe, split into forward + backward and the optimizer (JSON; the values "
                        "--step_times takes), and exit")
    parser.add_argument("--runs", nargs="+", default=["spider", "llama"], choices=["spider", "llama", "llama_local", "bytes_only"])
    parser.add_argument("--name", default=None)
    parser.add_argument("--overrides", default="{}", help="JSON config overrides (Spider runs)")
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--batch_size", type=int, default=Recipe.batch_size,
                        help="sequences per step (single runs and --time_steps; the suite's rows set their own)")
    parser.add_argument("--muon_experts", action="store_true",
                        help="the routed MoE experts' matrices by Muon too, not AdamW (single runs and --time_steps; "
                        "Recipe.muon_experts, train_hf.py's flag of the same name; the recipe before 2026-11-26)")
    parser.add_argument("--lr", type=float, default=Recipe.lr)
    parser.add_argument("--muon_lr", type=float, default=DEFAULT_MUON_LR,
                        help="peak learning rate of torch.optim.Muon for the hidden matrices (0: AdamW for every "
                        "parameter, the recipe of the ablation table)")
    parser.add_argument("--eval_every", type=int, default=0)
    parser.add_argument("--same_init", action="store_true", help="a Spider variant starts the parameters it shares "
                        "with the default model from the default model's initial values (see train_and_score)")
    parser.add_argument("--seed", type=int, default=Recipe.seed,
                        help="seed of the initialisation and the window order (a seed-noise row: the same recipe again)")
    parser.add_argument("--text", action="append", default=[], help="extra text file to score (repeatable)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no_loops_curve", action="store_true")
    parser.add_argument("--out", default=None, help="write the rows as a JSON list")
    parser.add_argument("--save", default=None, help="save the trained model (save_pretrained) under this folder")
    parser.add_argument("--report", nargs="+", default=None,
                        help="render the Model quality section of docs/results.md from these JSON files")
    parser.add_argument("--write_results", default=None,
                        help="with --report: replace the quality block of this file (docs/results.md)")
    parser.add_argument("--plot", default=None, help="with --report: write the bpb-vs-wall-clock plot here")
    parser.add_argument("--write_card_reference", default=None,
                        help="with --report: write the default recipe's comparison for the model card here "
                        "(hub_card/reference_quality.json)")
    args = parser.parse_args(argv)
    if args.report:
        rows = [r for f in args.report for r in json.loads(Path(f).read_text())]
        section = render(rows)
        if args.plot:
            plot(rows, args.plot)
        if args.write_card_reference:
            Path(args.write_card_reference).write_text(json.dumps(card_reference(rows), indent=1) + "\n")
        if args.write_results:
            from bench.report import write_block

            write_block(args.write_results, section, start="<!-- quality:start -->", end="<!-- quality:end -->")
        print(section)
        return rows
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.time_steps:
        split = {kind: step_split(kind, {}, Recipe(batch_size=args.batch_size, muon_experts=args.muon_experts))
                 for kind in ("spider", "llama", "bytes_only")}
        print(json.dumps({"threads": torch.get_num_threads(), "seconds_per_step": split}))
        return [split]
    texts = {Path(t).stem: text_file_ids(t) for t in args.text}
    if args.suite:
        shard, num_shards = (int(x) for x in args.shard.split("/"))
        rows = run_suite(shard, num_shards, {"pydoc_topics": technical_text_ids(), **texts}, steps=args.steps,
                         out=args.out, only=args.only,
                         step_times=json.loads(args.step_times) if args.step_times else None)
    else:
        recipe = Recipe(steps=args.steps, lr=args.lr, batch_size=args.batch_size, eval_every=args.eval_every,
                        seed=args.seed, same_init=args.same_init, muon_lr=args.muon_lr or None,
                        muon_experts=args.muon_experts,
                        warmup_steps=min(200, max(1, args.steps // 10)))
        rows = []
        for kind in args.runs:
            row = train_and_score(kind, args.name or kind, json.loads(args.overrides) if kind != "llama" else {},
                                  recipe, texts, loops_curve=not args.no_loops_curve,
                                  save=args.save and f"{args.save}/{kind}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
