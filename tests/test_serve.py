"""The OpenAI-compatible server (``spider-serve``), driven by the official ``openai`` client against a server
on localhost: every answer is compared with what ``model.generate`` gives for the same prompt alone.

The release is a tiny model trained for a few seconds to continue a text with multi-byte characters, so that greedy
outputs hold them (a random model writes mostly invalid UTF-8).
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from spider_training.commands.serve import Engine, Job, build_app, load_release, serving_in_thread
from tests.helpers import tiny_model
from tokenization_spider import SpiderTokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = "Spider says: héllo wörld — 日本語 🕷️ ça va? "
PROMPT = "Spider says: hé"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """`(folder, model, tokenizer)`: a tiny model that has learned `TEXT` by heart, saved as a release."""
    tokenizer = SpiderTokenizer()
    model = tiny_model(seed=0)
    ids = torch.tensor([[tokenizer.bos_token_id, *(TEXT * 3).encode()]])
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one draw everywhere, and the fastest for a model this small (~5 s)
    try:
        for _ in range(100):
            model.train()
            optimizer.zero_grad()
            model(ids, labels=ids).loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    folder = tmp_path_factory.mktemp("release")
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def server(release):
    """`(base_url, app)` of a server on the release, loaded through trust_remote_code as ``spider-serve`` does."""
    model, tokenizer = load_release(str(release[0]), "cpu")
    app = build_app(model, tokenizer, "spider", batch_wait_s=0.2)
    with serving_in_thread(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected(release, prompt: str, max_tokens: int, n_loops: int | None = None, prompt_ids=None) -> tuple[str, str]:
    """`(text, finish_reason)` of greedy ``model.generate`` on `prompt` alone (BOS + bytes, or `prompt_ids`)."""
    _, model, tokenizer = release
    ids = prompt_ids or [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    ids = torch.tensor([ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        n_loops=n_loops,
    )
    new = out[0, ids.shape[1] :].tolist()
    reason = "stop" if new[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(new, skip_special_tokens=True), reason


def post_raw(url: str, body: bytes) -> tuple[int, dict]:
    """POST `body` as JSON to `url`; `(status, decoded JSON answer)`."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_models_and_a_completion(release, client):
    assert [m.id for m in client.models.list().data] == ["spider"]
    out = client.completions.create(model="spider", prompt=PROMPT, max_tokens=40, temperature=0)
    text, reason = expected(release, PROMPT, 40)
    assert out.choices[0].text == text and out.choices[0].finish_reason == reason
    assert out.usage.prompt_tokens == 1 + len(PROMPT.encode()) and out.usage.completion_tokens == 40


def test_streamed_chunks_are_whole_characters_and_join_to_the_completion(release, server, client):
    text, _ = expected(release, PROMPT, 60)
    assert re.search(r"[^\x00-\x7f\ufffd]", text), text  # the output holds multi-byte characters
    whole = client.completions.create(model="spider", prompt=PROMPT, max_tokens=60, temperature=0)
    chunks = [
        c.choices[0].text
        for c in client.completions.create(model="spider", prompt=PROMPT, max_tokens=60, temperature=0, stream=True)
    ]
    assert "".join(chunks) == whole.choices[0].text == text
    assert all("\ufffd" not in chunk for chunk in chunks) and sum(1 for c in chunks if c) > 5

    # on the wire: SSE events, each a JSON chunk of valid UTF-8, ending with [DONE]
    body = json.dumps({"model": "spider", "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True})
    request = urllib.request.Request(
        server[0] + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line.decode("utf-8") for line in response.read().split(b"\n\n") if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads) and payloads[-1]["choices"][0]["finish_reason"]
    assert "".join(p["choices"][0]["text"] for p in payloads) == text


def test_concurrent_clients_are_batched_and_each_gets_what_it_gets_alone(release, server, client):
    model = server[1].state.engine.model
    batch_sizes = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append((args[0] if args else kwargs["input_ids"]).shape),
        with_kwargs=True,
    )
    prompts = [
        ("The state", 30, None),
        ("Spider says: héllo", 45, None),
        ("ça", 12, None),
        ("日本語 ", 50, None),
        ("The union is", 25, 1),
        ("wörld", 40, 1),
        ("x", 35, None),
        ("Spider", 20, None),
    ]
    results = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def ask(i):
        prompt, max_tokens, n_loops = prompts[i]
        barrier.wait()
        results[i] = client.completions.create(
            model="spider",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"n_loops": n_loops} if n_loops else None,
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        hook.remove()
    for (prompt, max_tokens, n_loops), out in zip(prompts, results):
        text, reason = expected(release, prompt, max_tokens, n_loops)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text, reason), prompt
    prefills = [shape for shape in batch_sizes if shape[1] > 1]
    assert max(shape[0] for shape in prefills) > 1, prefills  # requests were generated together
    assert len(prefills) < len(prompts)


def _engine_batches(release, batch_wait_s: float, max_batch_size: int, submit) -> list[int]:
    """The sizes of the batches a running :class:`Engine` on the release generates while `submit(engine, job)` is
    called on three-byte jobs (each generated for real); fails if they are not all done within 120 s."""
    model, tokenizer = load_release(str(release[0]), "cpu")
    engine = Engine(model, tokenizer.pad_token_id, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s)
    batches, done, generate = [], threading.Semaphore(0), engine.generate

    def recording_generate(jobs):
        batches.append(len(jobs))
        generate(jobs)
        for _ in jobs:
            done.release()

    engine.generate = recording_generate
    jobs = [Job(prompt_ids=[256, *b"The state"], budget=3, n_loops=1, act_early_exit=False) for _ in range(5)]
    engine.start()
    try:
        for job in jobs:
            submit(engine, job)
        assert all(done.acquire(timeout=120) for _ in jobs), batches
    finally:
        engine.stop()
    assert all(job.generated == 3 for job in jobs)
    return batches


def test_a_burst_of_requests_joins_one_batch(release):
    """Requests arriving 0.4 s apart, each before the last one's 1 s quiet period ends, join one batch (a fixed wait
    after the first would split them: the burst lasts 1.6 s)."""

    def submit(engine, job):
        engine.submit(job)
        time.sleep(0.4)

    assert _engine_batches(release, batch_wait_s=1.0, max_batch_size=8, submit=submit) == [5]


def test_a_full_batch_starts_without_waiting(release):
    """With `max_batch_size` jobs waiting the batch starts at once: a quiet period of 10 minutes is never waited."""
    assert _engine_batches(release, batch_wait_s=600.0, max_batch_size=5, submit=Engine.submit) == [5]


def _join_mid_batch(release, prompts, starting: int, join_after: int, timeout: float, **engine_kwargs):
    """An ``Engine`` (`engine_kwargs`) on greedy jobs of `prompts` (``(text, budget)`` pairs): the first `starting`
    queued together, the last one submitted once the first has generated `join_after` bytes. Returns ``(jobs, the
    batch sizes generate was called with, the prefills as (rows, bytes the first job had generated))``."""
    model, tokenizer = load_release(str(release[0]), "cpu")
    engine = Engine(model, tokenizer.pad_token_id, batch_wait_s=0.01, **engine_kwargs)
    batches, prefills, ended = [], [], threading.Semaphore(0)
    generate, prefill = engine.generate, engine._prefill
    jobs = [Job(prompt_ids=[tokenizer.bos_token_id, *prompt.encode()], budget=budget, n_loops=model.config.n_loops,
                act_early_exit=False, temperature=0, eos_token_id=tokenizer.eos_token_id)
            for prompt, budget in prompts]  # fmt: skip

    def recording_generate(batch):
        batches.append(len(batch))
        generate(batch)
        ended.release()

    def recording_prefill(rows, filler, cache=None):
        prefills.append((len(rows), jobs[0].generated))
        return prefill(rows, filler, cache)

    engine.generate, engine._prefill = recording_generate, recording_prefill
    with engine.condition:
        engine.waiting += jobs[:starting]
    engine.start()
    try:
        deadline = time.monotonic() + timeout
        while jobs[0].generated < join_after and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.submit(jobs[-1])
        assert ended.acquire(timeout=timeout), "the batch did not end"
    finally:
        engine.stop()
        if engine.compile:
            del model.model.compiled_decode
    return jobs, batches, prefills


def test_a_request_arriving_mid_batch_joins_it_and_gets_what_it_gets_alone(release):
    """Continuous batching: a request that arrives while a batch decodes is prefilled on its own and joins that batch
    at the next step (one batch in all), and each request's text is greedy ``generate`` on its prompt alone."""
    prompts = [("The state", 60), ("Spider says: héllo", 20)]
    jobs, batches, prefills = _join_mid_batch(release, prompts, 1, 5, 120, max_batch_size=4)
    assert batches == [1] and len(prefills) == 2 and prefills[0] == (1, 0), (batches, prefills)
    assert prefills[1][0] == 1 and 5 <= prefills[1][1] < jobs[0].generated, prefills  # joined mid-batch
    for job, (prompt, budget) in zip(jobs, prompts):
        assert job.text == expected(release, prompt, budget)[0], prompt


@pytest.mark.slow
def test_a_request_takes_a_finished_requests_row_in_a_compiled_batch(release):
    """``--compile``: a request that arrives once a row of the fixed batch has finished is prefilled on its own and
    written into that row (``SpiderStaticCache.write_row``), in the same batch; each text is greedy ``generate`` on
    its prompt alone."""
    prompts = [("The state", 40), ("Spider", 6), ("Spider: héllo", 12)]
    jobs, batches, prefills = _join_mid_batch(release, prompts, 2, 10, 300, max_batch_size=2, compile=True)
    assert batches == [2] and len(prefills) == 2 and prefills[0] == (2, 0), (batches, prefills)
    assert prefills[1][0] == 1 and 10 <= prefills[1][1] < jobs[0].generated, prefills  # joined mid-batch
    for job, (prompt, budget) in zip(jobs, prompts):
        assert job.text == expected(release, prompt, budget)[0], prompt


@pytest.mark.slow
def test_compiled_server_keeps_fixed_batch_slots_and_each_client_gets_what_it_gets_alone(release):
    """``--compile``: three concurrent requests fill a batch of four fixed rows (one filler) over a
    ``SpiderStaticCache``; the rows of requests that end early stay in the batch, and every answer, streamed or not,
    equals greedy ``generate`` on its prompt alone."""
    model, tokenizer = load_release(str(release[0]), "cpu")
    app = build_app(model, tokenizer, "spider", batch_wait_s=0.5, compile=True)
    shapes, caches = [], []

    def record(module, args, kwargs):
        shapes.append(tuple((args[0] if args else kwargs["input_ids"]).shape))
        caches.append(type(kwargs.get("cache")).__name__)

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    prompts = [("The state", 30), ("Spider says: héllo", 12), ("日本語 ", 45)]
    results = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))
    try:
        with serving_in_thread(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

            def ask(i):
                prompt, max_tokens = prompts[i]
                barrier.wait()
                create = dict(model="spider", prompt=prompt, max_tokens=max_tokens, temperature=0)
                if i == 2:  # streamed
                    chunks = list(client.completions.create(**create, stream=True))
                    results[i] = ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason)
                else:
                    out = client.completions.create(**create).choices[0]
                    results[i] = (out.text, out.finish_reason)

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
    finally:
        hook.remove()
    for (prompt, max_tokens), result in zip(prompts, results):
        assert result == expected(release, prompt, max_tokens), prompt
    assert {shape[0] for shape in shapes} == {4}  # one batch of 4 rows from the prefill to the last step
    assert sum(shape[1] > 1 for shape in shapes) == 1 and set(caches) == {"SpiderStaticCache"}
    assert len(shapes) == 1 + max(max_tokens for _, max_tokens in prompts) - 1
    del model.model.compiled_decode


BAD_REQUESTS = {  # name -> (body, the field the message names)
    "unknown model": ({"model": "gpt-4", "prompt": "hi"}, "model"),
    "n_loops 0": ({"model": "spider", "prompt": "hi", "n_loops": 0}, "n_loops"),
    "n_loops past max_loop_iters": ({"model": "spider", "prompt": "hi", "n_loops": 5}, "n_loops"),
    "prompt longer than the context": ({"model": "spider", "prompt": "a" * 600}, "prompt"),
    "max_tokens 0": ({"model": "spider", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"model": "spider", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    "prompt of token ids": ({"model": "spider", "prompt": [1, 2, 3]}, "prompt"),
    "prompt a number": ({"model": "spider", "prompt": 12}, "prompt"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_request_gets_400_naming_the_field_and_the_server_stays_up(name, release, client):
    body, param = dict(BAD_REQUESTS[name][0]), BAD_REQUESTS[name][1]
    assert release[1].config.max_loop_iters == 4 and release[1].config.max_position_embeddings == 512
    extra = {"n_loops": body.pop("n_loops")} if "n_loops" in body else None
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"max_tokens": 4, **body}, temperature=0, extra_body=extra)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and param in error["message"], error
    assert client.completions.create(model="spider", prompt="hi", max_tokens=3).choices[0].text is not None


def test_invalid_json_and_chat_without_a_template_get_400(server, client):
    status, answer = post_raw(server[0] + "/v1/completions", b'{"model": "spider", "prompt": ')
    assert status == 400 and "JSON" in answer["error"]["message"]
    status, answer = post_raw(server[0] + "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in answer["error"]["message"]
    status, answer = post_raw(server[0] + "/v1/completions", b'{"model": "spider"}')
    assert status == 400 and answer["error"]["param"] == "prompt" and "prompt" in answer["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="spider", messages=[{"role": "user", "content": "hi"}])
    assert client.completions.create(model="spider", prompt="hi", max_tokens=3).choices[0].finish_reason


def test_a_client_that_disconnects_stops_its_generation_and_others_go_on(release, server, client):
    model = server[1].state.engine.model
    steps = []
    hook = model.register_forward_pre_hook(lambda module, args: steps.append(time.monotonic()))
    try:
        other = client.completions.create(
            model="spider", prompt="The state", max_tokens=150, temperature=0, stream=True
        )
        leaving = client.completions.create(model="spider", prompt=PROMPT, max_tokens=480, temperature=0, stream=True)
        for _, _ in zip(range(3), leaving):
            pass
        leaving.close()  # the client goes away mid-stream
        assert "".join(c.choices[0].text for c in other) == expected(release, "The state", 150)[0]
        while not steps or time.monotonic() - steps[-1] < 1.0:  # until the engine is idle
            time.sleep(0.1)
        assert len(steps) < 480  # the departed request's 480 bytes were not all generated
    finally:
        hook.remove()
    text, _ = expected(release, PROMPT, 20)
    assert (
        client.completions.create(model="spider", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text == text
    )


def test_stop_strings_cut_the_output_streamed_or_not(release, client):
    text, _ = expected(release, PROMPT, 60)
    stop = text[8:11]
    cut = text[: text.find(stop)]
    for stream in (False, True):
        out = client.completions.create(
            model="spider", prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop, "#"], stream=stream
        )
        chunks = [c.choices[0] for c in out] if stream else out.choices
        assert "".join(c.text for c in chunks) == cut and chunks[-1].finish_reason == "stop"


def test_sampling_knobs(release, client):
    greedy, _ = expected(release, "The state", 30)
    ask = {"model": "spider", "prompt": "The state", "max_tokens": 30}
    # top_p this small leaves only the likeliest byte: greedy
    assert client.completions.create(**ask, temperature=1.0, top_p=1e-6).choices[0].text == greedy
    seeded = [client.completions.create(**ask, seed=7, temperature=2.0).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1] != greedy


def test_act_early_exit_per_request(release, client):
    model = release[1]
    out = client.completions.create(
        model="spider", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"act_early_exit": True, "n_loops": 3}
    )
    model.config.act_early_exit = True
    try:
        text, _ = expected(release, PROMPT, 30, n_loops=3)
    finally:
        model.config.act_early_exit = False
    assert out.choices[0].text == text


def test_chat_completions_with_a_chat_template(release):
    tokenizer = SpiderTokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    model, _ = load_release(str(release[0]), "cpu")
    messages = [{"role": "user", "content": PROMPT}]
    with serving_in_thread(build_app(model, tokenizer, "spider")) as url:
        chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = chat.chat.completions.create(model="spider", messages=messages, max_tokens=30, temperature=0)
        chunks = list(
            chat.chat.completions.create(
                model="spider", messages=messages, max_completion_tokens=30, temperature=0, stream=True
            )
        )
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == f"user: {PROMPT}\nassistant: "
    text, _ = expected(release, prompt, 30)
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def _readme_serving_block() -> tuple[str, str, str]:
    """The README's serving recipe: `(the spider-serve command, the curl line, the Python block)`."""
    block = README.read_text().split("<!-- recipe:serve -->", 1)[1]
    bash = block.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    command = next(line for line in bash.splitlines() if line.startswith("spider-serve "))
    curl = next(line for line in bash.splitlines() if line.startswith("curl "))
    return command, curl, block.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_readme_serving_recipe_as_written(release, tmp_path):
    """The README's command, curl line and openai client lines, with this test's release and a free port."""
    folder = str(release[0])
    command, curl, python = _readme_serving_block()
    port = _free_port()

    def here(line: str) -> str:
        return line.replace("runs/spider-small/release", folder).replace("localhost:8000", f"localhost:{port}")

    argv = shlex.split(here(command), comments=True) + ["--port", str(port)]
    argv[0] = shutil.which("spider-serve", path=str(Path(sys.executable).parent)) or argv[0]
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    with subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        try:
            _wait_for(f"http://127.0.0.1:{port}/v1/models", process)
            text, _ = expected(release, "The state of the union", 64)
            done = subprocess.run(
                shlex.split(here(curl), comments=True), capture_output=True, text=True, timeout=120, check=False
            )
            assert json.loads(done.stdout)["choices"][0]["text"] == text
            done = subprocess.run(
                [sys.executable, "-c", here(python)], capture_output=True, text=True, timeout=120, check=False
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith(text)
        finally:
            process.terminate()
            process.wait(30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()[-3000:]
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"spider-serve did not answer {url} within {timeout} s")
