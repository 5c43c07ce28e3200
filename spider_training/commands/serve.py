"""Serve a Spider release over HTTP in the shape of OpenAI's API: ``spider-serve RELEASE`` or
``python -m spider_training.commands.serve RELEASE [--host H] [--port P]``.

Endpoints (FastAPI on uvicorn): ``GET /v1/models``, ``POST /v1/completions`` and, when the release's tokenizer has a
chat template, ``POST /v1/chat/completions``. Tokens are bytes: ``max_tokens`` counts bytes, ``usage`` counts ids.
Besides OpenAI's ``temperature``, ``top_p``, ``stop``, ``stream`` and ``seed``, a request may set Spider's own
``n_loops`` (``1..config.max_loop_iters``) and ``act_early_exit``. A bad request gets HTTP 400 with an OpenAI-style
error object whose ``param`` and message name the field.

Concurrent requests are batched: a worker thread (:class:`Engine`) takes up to ``--max-batch-size`` waiting requests
that share ``n_loops`` and ``act_early_exit``, left-pads their prompts into one batch, prefills Spider's cache and
decodes one byte per row per step, sampling each row with its own settings. A row leaves the batch (its cache rows
dropped) when it ends: end of text, ``max_tokens``, a ``stop`` string, or its client going away (with ``--compile``
the caches have fixed sizes and compiled decode steps: a finished row stays, ignored, until a waiting request takes
it). Each row's bytes
are decoded incrementally, so a streamed chunk only ever holds whole UTF-8 characters; text that may be the start of
a ``stop`` string is held back until it is known not to be.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

logger = logging.getLogger(__name__)
#: most quiet periods (``batch_wait_s`` each) a batch waits for a burst of requests to end before it starts anyway
MAX_BATCH_WAITS = 10


class BadRequest(Exception):
    """A request the server refuses with HTTP 400; `param` names the field at fault (None: the whole body)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- requests --------------------------------------------------------------------------------------------------------


class SamplingFields(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1)
    seed: int | None = None
    n_loops: int | None = Field(None, ge=1)
    act_early_exit: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of at most 4 non-empty strings")
        return stops


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: `prompt` is text (a string, or a list holding one string)."""

    prompt: str | list[str]
    max_tokens: int | None = Field(16, gt=0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_prompt(cls, value):
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not isinstance(value, str):
            raise ValueError(  # noqa: TRY004 (pydantic reports a ValueError as a validation error)
                f"must be text (one string), got {type(value).__name__} (token ids are not accepted)"
            )
        return value


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``: `messages` with text content (a string or a list of ``text`` parts)."""

    messages: list[dict] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)

    @field_validator("messages")
    @classmethod
    def _text_messages(cls, messages):
        out = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(message.get("role"), str) or not isinstance(content, str):
                raise ValueError(f"messages[{i}] must have a string role and text content")  # noqa: TRY004
            out.append({**message, "content": content})
        return out


def parse_request(body: bytes, kind: type[BaseModel]) -> BaseModel:
    """`body` (JSON bytes) validated as `kind`.

    Raises:
        BadRequest: not JSON, or a field that fails validation (named in the message and as `param`).
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"][:1]) or None
        raise BadRequest(f"{param}: {first['msg'].removeprefix('Value error, ')}", param) from None


# --- generation ------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """One request's generation: its prompt ids, how many bytes it may write (`budget`, >= 1) and how to sample.

    The engine's thread calls :meth:`step` with each new id; the job turns ids into whole characters and posts
    ``("text", str)`` then ``("done", finish_reason, completion_tokens)`` (or ``("error", message)``) to `events`,
    an asyncio queue of the server's event loop `loop`. :meth:`cancel` (any thread) drops it from its batch."""

    prompt_ids: list[int]
    budget: int
    n_loops: int
    act_early_exit: bool
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    eos_token_id: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    generated: int = 0
    text: str = ""
    sent: int = 0  # characters of `text` posted so far
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.generator = None if self.seed is None else torch.Generator().manual_seed(self.seed)

    def cancel(self) -> None:
        """Stop generating for this job (its row leaves the batch at the next step); posts nothing more."""
        self.cancelled.set()

    def post(self, *event) -> None:
        """Hand `event` to the job's event loop (dropped once the job is cancelled or the loop has closed)."""
        if self.cancelled.is_set() or self.loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def step(self, token: int) -> bool:
        """Take the next generated id; returns whether the job goes on (False: finished or cancelled)."""
        if self.cancelled.is_set():
            return False
        self.generated += 1
        if token == self.eos_token_id:
            return self.finish("stop")
        if token < 256:  # ids >= 256 are special: they count, but write no text
            self.text += self.decoder.decode(bytes([token]))
        if self._cut_at_stop():
            return self.finish("stop")
        if self.generated >= self.budget:
            return self.finish("length")
        held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        self._post_text(len(self.text) - held)
        return True

    def finish(self, reason: str) -> bool:
        """Flush the decoder (an unfinished character becomes U+FFFD), post the rest of the text and ``done``."""
        self.text += self.decoder.decode(b"", final=True)
        reason = "stop" if self._cut_at_stop() else reason
        self._post_text(len(self.text))
        self.post("done", reason, self.generated)
        return False

    def _cut_at_stop(self) -> bool:
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
        return bool(found)

    def _post_text(self, end: int) -> None:
        if end > self.sent:
            self.post("text", self.text[self.sent : end])
            self.sent = end


def next_tokens(logits: torch.Tensor, jobs: list[Job | None]) -> torch.Tensor:
    """The next id of each row: `logits` `(B, V)` float, one job (or None: greedy) per row -> `(B,)` int64. Greedy
    where there is no job or its
    temperature is 0, else sampled from ``softmax(logits / temperature)`` restricted to the smallest set of ids whose
    probability reaches `top_p` (transformers' ``TopPLogitsWarper``), with the job's own generator when it has a seed.
    """
    chosen = logits.argmax(-1)
    for row, job in enumerate(jobs):
        if job is None or job.temperature == 0:
            continue
        probs = torch.softmax(logits[row].float() / job.temperature, -1)
        if job.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= job.top_p  # the first id is always kept
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        chosen[row] = torch.multinomial(probs, 1, generator=job.generator)[0]
    return chosen


class Engine:
    """Generates queued :class:`Job` s in batches on a worker thread (:meth:`start`, :meth:`stop`).

    Args:
        model: a Spider ``...ForCausalLM`` in eval mode; the engine is its only user while running (it sets
            ``model.config.act_early_exit`` per batch).
        pad_token_id: the id left padding uses (masked out).
        max_batch_size: most jobs generated together.
        batch_wait_s: seconds without a new job after which the worker starts a batch (a burst of concurrent
            requests joins one batch; at most ``MAX_BATCH_WAITS * batch_wait_s`` in all).
        compile: decode over fixed-size caches (``SpiderStaticCache``: a batch of 1, 2, 4, 8... rows, the extra
            rows and finished jobs' rows kept and ignored until a waiting job takes one; a length rounded up to a
            power of two) whose decode step's
            regions are compiled (``compile_decode``) once per shape: the first batch of each shape pays the compile.
            Without it a growing ``SpiderCache`` drops each job's rows when it ends.
    """

    def __init__(
        self, model, pad_token_id: int, max_batch_size: int = 8, batch_wait_s: float = 0.01, compile: bool = False
    ):
        self.model, self.pad_token_id = model, pad_token_id
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self.compile = compile
        if compile:
            model.model.compile_decode()
        self.context = model.config.max_position_embeddings
        self.waiting: list[Job] = []
        self.condition = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._work, name="spider-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Finish the batch in progress, then end the worker thread (queued jobs are left unanswered)."""
        with self.condition:
            self.closed = True
            self.condition.notify()
        self.thread.join()

    def submit(self, job: Job) -> None:
        """Queue `job`; its prompt plus its budget must fit the context (``budget <= context + 1 - len(prompt)``)."""
        with self.condition:
            self.waiting.append(job)
            self.condition.notify()

    def _fits(self, jobs: list[Job], seen_bytes: int = 0) -> bool:
        # every row is fed at most (budget - generated) - 1 more bytes after the prompts, aligned at the right of
        # `seen_bytes` columns (a running batch's) or of the longest prompt, which must stay within the context
        width = max(seen_bytes, *(len(job.prompt_ids) for job in jobs))
        return all(width + job.budget - job.generated - 1 <= self.context for job in jobs)

    def _take_waiting(self, rows: list[Job], seen_bytes: int = 0) -> list[Job]:
        """(With `condition` held.) Waiting jobs, oldest first, that can join `rows` (a running batch of
        `seen_bytes` columns, or none): the first row's `n_loops` and `act_early_exit`, room under `max_batch_size`,
        and every row within the context (:meth:`_fits`). They leave the queue; cancelled ones are dropped."""
        return self._take_waiting_where(
            self.max_batch_size - len(rows),
            lambda taken, job: self._compatible(job, [*rows, *taken]) and self._fits([*rows, *taken, job], seen_bytes),
        )

    def _take_waiting_where(self, room: int, can_join: Callable[[list[Job], Job], bool]) -> list[Job]:
        """(With `condition` held.) Up to `room` waiting jobs, oldest first, for which ``can_join(taken so far,
        job)``; they leave the queue, and cancelled ones are dropped."""
        self.waiting = [job for job in self.waiting if not job.cancelled.is_set()]
        taken: list[Job] = []
        for job in list(self.waiting):
            if len(taken) >= room:
                break
            if can_join(taken, job):
                taken.append(job)
                self.waiting.remove(job)
        return taken

    def _take_batch(self) -> list[Job] | None:
        """The next batch: up to `max_batch_size` waiting jobs with the first one's `n_loops` and `act_early_exit`
        that fit the context together, taken once no job has arrived for `batch_wait_s` (a burst of requests joins
        one batch however long it lasts, up to :data:`MAX_BATCH_WAITS` waits) or once `max_batch_size` jobs wait.
        None once :meth:`stop` was called."""
        with self.condition:
            while not self.waiting and not self.closed:
                self.condition.wait()
            if self.closed:
                return None
            deadline = time.monotonic() + MAX_BATCH_WAITS * self.batch_wait_s
            while len(self.waiting) < self.max_batch_size and not self.closed:
                arrived = len(self.waiting)
                quiet = not self.condition.wait(max(0.0, min(self.batch_wait_s, deadline - time.monotonic())))
                if (quiet and len(self.waiting) == arrived) or time.monotonic() >= deadline:
                    break
            return self._take_waiting([])

    def _work(self) -> None:
        while (batch := self._take_batch()) is not None:
            if not batch:
                continue
            try:
                self.generate(batch)
            except Exception as err:  # the server goes on; these requests fail
                logger.exception("generation failed")
                for job in batch:
                    job.post("error", f"generation failed: {type(err).__name__}: {err}")

    def _take_free_rows(self, rows: list[Job | None], first: Job, cache) -> list[Job]:
        """(With `condition` held.) Waiting jobs, oldest first, that can take the free (None) `rows` of a compiled
        batch over the fixed-size `cache`: `first`'s `n_loops` and `act_early_exit`, a prompt no longer than the
        columns decoded so far and a budget that ends within ``cache.max_cache_len``. They leave the queue."""
        return self._take_waiting_where(
            rows.count(None),
            lambda taken, job: (
                self._compatible(job, [first])
                and len(job.prompt_ids) <= cache.seen_bytes
                and cache.seen_bytes + job.budget - 1 <= cache.max_cache_len
            ),
        )

    def _compatible(self, job: Job, batch: list[Job]) -> bool:
        return not batch or (job.n_loops, job.act_early_exit) == (batch[0].n_loops, batch[0].act_early_exit)

    def _prefill(self, rows: list[Job | None], filler: Job, cache=None):
        """The full forward over the rows' prompts, left-padded (a None row: `filler`'s prompt), into `cache` (None:
        a new ``SpiderCache``); returns the last position's logits `(len(rows), V)` and the cache."""
        prompts = [(job or filler).prompt_ids for job in rows]
        width = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        device = self.model.device
        out = self.model(
            ids.to(device), attention_mask=mask.to(device), n_loops=filler.n_loops, cache=cache, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        return out.logits[:, -1], out.cache

    @torch.inference_mode()
    def generate(self, jobs: list[Job]) -> None:
        """Generate `jobs` (same `n_loops` and `act_early_exit`) as one left-padded batch, feeding each job the ids
        it gets. A row leaves the batch, and Spider's cache, when its job ends; waiting jobs join the batch between
        two steps while it has room (continuous batching: each prefilled on its own, its rows appended with
        ``SpiderCache.add_rows``). With `compile` the batch keeps its rows (a fixed shape): finished or filler rows
        (copies of the first job's prompt) are ignored until a waiting job takes one (prefilled on its own, written
        in with ``SpiderStaticCache.write_row`` when its prompt is no longer than the columns decoded so far)."""
        rows: list[Job | None] = list(jobs)
        cache = None
        n_loops = jobs[0].n_loops
        if self.compile:
            # the release's own generation_spider (trust_remote_code loads a copy of it beside modeling_spider)
            modeling = sys.modules[type(self.model).__module__]
            SpiderStaticCache = sys.modules[modeling.SpiderCache.__module__].SpiderStaticCache  # noqa: N806

            rows += [None] * (min(self.max_batch_size, 1 << (len(jobs) - 1).bit_length()) - len(jobs))
            length = max(len(job.prompt_ids) + job.budget - 1 for job in jobs)
            cache = SpiderStaticCache(self.model.config, n_loops, min(self.context, 1 << (length - 1).bit_length()))
        self.model.config.act_early_exit = jobs[0].act_early_exit
        logits, cache = self._prefill(rows, jobs[0], cache)
        while True:
            if not self.compile:
                with self.condition:
                    joining = self._take_waiting(rows, cache.seen_bytes)
                if joining:
                    joining_logits, joining_cache = self._prefill(joining, joining[0])
                    cache.add_rows(joining_cache)
                    rows, logits = rows + joining, torch.cat([logits, joining_logits])
            elif None in rows:
                with self.condition:
                    joining = self._take_free_rows(rows, jobs[0], cache)
                for job in joining:  # each prefilled on its own, written into a free row of the fixed batch
                    row = rows.index(None)
                    job_logits, job_cache = self._prefill(
                        [job], job, SpiderStaticCache(self.model.config, n_loops, cache.max_cache_len)
                    )
                    cache.write_row(row, job_cache)
                    rows[row], logits[row] = job, job_logits[0]
            chosen = next_tokens(logits, rows)
            rows = [job if job is not None and job.step(token) else None for job, token in zip(rows, chosen.tolist())]
            if all(job is None for job in rows):
                return
            if not self.compile and None in rows:
                keep = torch.tensor([row for row, job in enumerate(rows) if job is not None], device=chosen.device)
                cache.batch_select_indices(keep)
                chosen, rows = chosen[keep], [job for job in rows if job is not None]
            logits = self.model(chosen[:, None], n_loops=n_loops, cache=cache, logits_to_keep=1).logits[:, -1]


# --- the http layer --------------------------------------------------------------------------------------------------


class JobStream(StreamingResponse):
    """A streamed response that cancels its job however the response ends (done, error, client gone)."""

    def __init__(self, job: Job, content):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def build_app(
    model, tokenizer, model_name: str, max_batch_size: int = 8, batch_wait_s: float = 0.01, compile: bool = False
) -> FastAPI:
    """The FastAPI app serving `model` (a Spider ``...ForCausalLM``, eval mode) and its `tokenizer` as `model_name`.

    The app's lifespan starts and stops an :class:`Engine` (``app.state.engine``) with `max_batch_size`,
    `batch_wait_s` and `compile`; run it with uvicorn (:func:`cli`) or any ASGI server."""
    config = model.config
    context, max_loops, default_exit = config.max_position_embeddings, config.max_loop_iters, config.act_early_exit

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine = Engine(model, tokenizer.pad_token_id, max_batch_size, batch_wait_s, compile)
        app.state.engine.start()
        yield
        await asyncio.to_thread(app.state.engine.stop)

    app = FastAPI(title="Spider", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, err: BadRequest):
        return JSONResponse(error_body(err.message, "invalid_request_error", err.param, err.code), status_code=400)

    def make_job(req: SamplingFields, prompt_ids: list[int], max_tokens: int | None) -> Job:
        if req.model != model_name:
            raise BadRequest(
                f"model: unknown model {req.model!r}; this server serves {model_name!r}", "model", "model_not_found"
            )
        n_loops = config.n_loops if req.n_loops is None else req.n_loops
        if not 1 <= n_loops <= max_loops:
            raise BadRequest(f"n_loops: must be in 1..{max_loops} (max_loop_iters), got {n_loops}", "n_loops")
        param = "prompt" if isinstance(req, CompletionRequest) else "messages"
        if len(prompt_ids) > context:
            raise BadRequest(
                f"{param}: the prompt is {len(prompt_ids)} bytes, longer than the context of {context} "
                "bytes (max_position_embeddings)",
                param,
                "context_length_exceeded",
            )
        room = context + 1 - len(prompt_ids)  # the last byte written is never fed back
        return Job(
            prompt_ids,
            min(room, max_tokens or room),
            n_loops,
            default_exit if req.act_early_exit is None else req.act_early_exit,
            req.temperature,
            req.top_p,
            req.stop or [],
            req.seed,
            tokenizer.eos_token_id,
            asyncio.get_running_loop(),
            asyncio.Queue(),
        )

    async def events(request: Request, job: Job, poll_s: float = 0.25):
        """The job's events, several texts joined into one; cancels the job when the client goes away."""
        request.app.state.engine.submit(job)
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), poll_s)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return
                continue
            text = ""
            while event is not None and event[0] == "text":  # join the texts already waiting
                text += event[1]
                event = None if job.events.empty() else job.events.get_nowait()
            if text:
                yield ("text", text)
            if event is not None:  # done or error
                yield event
                return

    async def respond(request: Request, req: SamplingFields, job: Job, chat: bool):
        """The job's answer: one JSON object, or (``stream``) SSE chunks ending with ``data: [DONE]``."""
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

        def usage(done: int) -> dict:
            prompt = len(job.prompt_ids)
            return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

        def choice(text: str | None, reason: str | None, key: str = "delta", role: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            content = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return {"index": 0, key: content, "logprobs": None, "finish_reason": reason}

        if not req.stream:
            text = ""
            async for event in events(request, job):
                if event[0] == "error":
                    return JSONResponse(error_body(event[1], "server_error"), status_code=500)
                if event[0] == "text":
                    text += event[1]
                else:
                    return {
                        **head,
                        "choices": [choice(text, event[1], "message", role=True)],
                        "usage": usage(event[2]),
                    }
            return JSONResponse(error_body("client disconnected", "client_closed"), status_code=499)

        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        def data(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def sse():
            if chat:
                yield data({**head, "choices": [choice("", None, role=True)]})
            async for event in events(request, job):
                if event[0] == "text":
                    yield data({**head, "choices": [choice(event[1], None)]})
                elif event[0] == "error":
                    yield data(error_body(event[1], "server_error"))
                else:
                    yield data({**head, "choices": [choice(None if chat else "", event[1])]})
                    if include_usage:
                        yield data({**head, "choices": [], "usage": usage(event[2])})
            yield "data: [DONE]\n\n"

        return JobStream(job, sse())

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "spider", "max_model_len": context}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(await request.body(), CompletionRequest)
        prompt_ids = [tokenizer.bos_token_id, *tokenizer(req.prompt, add_special_tokens=False)["input_ids"]]
        return await respond(request, req, make_job(req, prompt_ids, req.max_tokens), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest(
                "this release's tokenizer has no chat template: use /v1/completions", "messages", "no_chat_template"
            )
        from jinja2 import TemplateError

        req = parse_request(await request.body(), ChatRequest)
        try:
            text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError, TypeError, KeyError) as err:  # it refused the conversation
            raise BadRequest(f"messages: the chat template failed: {err}", "messages") from None
        # read as text after BOS, as a completion's prompt (Spider's tokenizer never matches special tokens in text)
        prompt_ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        return await respond(
            request, req, make_job(req, prompt_ids, req.max_completion_tokens or req.max_tokens), chat=True
        )

    return app


@contextlib.contextmanager
def serving_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0):
    """Run `app` with uvicorn in a daemon thread (port 0: a free one) and yield its base URL ``http://host:port``;
    stops the server on exit. What tests and ``bench.generation`` serve a release with, beside the console script.

    Raises:
        RuntimeError: the server's thread ended before it started listening."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def load_release(path: str, device: str | None = None):
    """`(model, tokenizer)` of the release folder `path`, loaded as a user would (``AutoModelForCausalLM`` /
    ``AutoTokenizer``, ``trust_remote_code=True``), the model in eval mode on `device` (default: CUDA if available).

    Raises:
        ValueError / OSError: as :func:`spider_training.release.checked_from_pretrained`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..release import checked_from_pretrained

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = checked_from_pretrained(AutoModelForCausalLM.from_pretrained, path, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer


def cli(argv: list[str] | None = None) -> None:
    """``spider-serve RELEASE [--host] [--port] [--served-model-name] [--max-batch-size] [--device] [--compile]``."""
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="spider-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("release", help="a release folder (what from_pretrained loads) or a Hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model id clients name (default: RELEASE)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="most requests generated together")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode over fixed-size caches with the decode step compiled (batches of 1, 2, 4, 8... rows, lengths "
        "rounded up to powers of two; the first batch of each shape pays the compile)",
    )
    args = parser.parse_args(argv)
    local = args.release.startswith(("/", ".", "~")) or args.release.count("/") != 1  # else maybe a Hub id
    if local and not Path(args.release).expanduser().is_dir():
        parser.error(f"{args.release}: no such release folder")
    model, tokenizer = load_release(str(Path(args.release).expanduser()) if local else args.release, args.device)
    app = build_app(
        model, tokenizer, args.served_model_name or args.release, args.max_batch_size, compile=args.compile
    )
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    cli()
