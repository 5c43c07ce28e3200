"""Push Spider checkpoints and the final release folder to the Hugging Face Hub without ever stalling training.

``transformers.Trainer``'s own ``push_to_hub=True`` calls ``create_repo`` when the Trainer is built (it raises when
the Hub is unreachable) and its pushes have no time limit. Spider's trainer keeps ``args.push_to_hub=False`` and uses
this module instead:

* :func:`push_folder` -- one bounded, never-raising upload of a local folder (``create_repo(exist_ok=True)`` +
  ``HfApi.upload_folder``) with retries and exponential back-off; returns a :class:`PushResult`.
* :class:`HubPushCallback` -- a ``TrainerCallback`` whose ``on_save`` pushes the newest ``checkpoint-N`` folder in a
  background thread (Trainer's ``hub_strategy="checkpoint"`` layout: ``last-checkpoint/`` in the repo, or
  ``"all_checkpoints"``: ``checkpoint-N/``), so training goes on while it uploads; ``wait()`` joins at the end.
* :func:`push_release` -- the final release folder (weights, config with ``auto_map``, remote-code ``.py`` files,
  tokenizer files, README model card, loss curve) to the repo root, blocking but bounded.

Failure policy. Network and HTTP errors never propagate: an attempt that fails is retried up to ``retries`` more
times, sleeping ``backoff_s * 2**(k-1)`` seconds (capped at ``max_backoff_s``) before retry ``k``; after the last one a
WARNING on the ``spider_training.hub`` logger names the repo, the folder and the error, and the result has
``ok=False``. HTTP 4xx answers other than 408/409/429 (bad token, no permission, invalid repo id on the server side),
``ValueError`` from huggingface_hub (invalid README metadata, a malformed server answer), a local file that vanished,
and huggingface_hub's offline mode (``HF_HUB_OFFLINE=1``) are not retried: retrying cannot fix them. Bad *local* input
(a folder that does not exist, a malformed ``repo_id``, a non-positive timeout) raises ``ValueError`` /
``FileNotFoundError`` / ``NotADirectoryError`` before anything is sent -- these are programming errors, not
network weather.

Time bound. The attempts run in a daemon worker thread; the caller waits at most ``timeout_s`` seconds in total, then
returns ``ok=False, timed_out=True`` and asks the worker to stop (it checks between attempts and during back-off).
A request that is in flight at that moment cannot be interrupted from outside: the worker thread lingers (daemon:
it never blocks interpreter exit) until that request fails on its own HTTP timeout. Those HTTP timeouts exist because
huggingface_hub 2.4's shared ``httpx2.Client`` has ``timeout=None`` and its upload calls (``create_repo``,
``preupload``, LFS ``PUT``, ``commit``) pass none -- a server that accepts the connection and never answers would
block forever. :func:`configure_http_timeouts` (called by every push) installs, through the public
``huggingface_hub.set_client_factory``, a client with finite connect/read/write timeouts, but only while the library's
default factory is in place -- a factory you installed yourself is left alone. The client is process-wide, so
downloads get the same (per-read, not total) timeouts; installing it closes the current shared client once.
(``HF_HUB_ETAG_TIMEOUT`` / ``HF_HUB_DOWNLOAD_TIMEOUT`` only govern downloads.) If the push finishes after the caller
stopped waiting, the commit still lands but the result already says ``ok=False``; a later push simply re-sends.

Xet vs. plain HTTP (measured on huggingface_hub 2.4.0 with ``hf_xet`` 1.8.0). With ``hf_xet`` installed and
``HF_HUB_DISABLE_XET`` unset, ``upload_folder`` runs its Xet pipeline: a ``preupload`` call asks the Hub which files
are "regular" (small text, sent base64 inside the commit) and which are large/binary (a 1-10 MB ``.safetensors`` and a
``.png`` always are); those go to Xet content-addressed storage (``GET .../xet-write-token/<rev>``, then the ``hf_xet``
Rust client chunks, deduplicates and uploads them) and a ``commit`` call references them. With
``HF_HUB_DISABLE_XET=1`` in the environment (read when huggingface_hub is imported; the runtime switch is
``huggingface_hub.constants.HF_HUB_DISABLE_XET``), the same files take the plain git-LFS path instead: LFS batch API,
one HTTP ``PUT`` per file (multipart above the Hub's part size), a ``verify`` call, then the ``commit``. Both work
against the real Hub; the local test double ``tests/hub_server.py`` speaks only the plain path. This module does not
toggle the switch (it is process-wide); Xet's own transfers are bounded by ``timeout_s`` like everything else.

Trainer integration (``train_hf.py``)::

    callback = HubPushCallback(args.hub_model_id, token=args.hub_token, private=args.hub_private_repo)
    trainer = SpiderTrainer(..., callbacks=[callback])      # args.push_to_hub stays False
    trainer.train()
    callback.wait(timeout_s=600)
    write release folder ...
    result = push_release(release_dir, args.hub_model_id, token=args.hub_token)
    # result.ok is False offline; the release is on disk either way

Only the process with ``state.is_world_process_zero`` pushes. Modelled on ``transformers.Trainer._push_from_checkpoint``
(``hub_strategy``, "skip a push while the previous one is in flight unless ``hub_always_push``").

Why not Trainer's own pushing (``push_to_hub=True``, ``hub_strategy``) or ``HfApi.upload_folder(run_as_future=True)``
(checked against transformers 5.23 / huggingface_hub 2.4): ``Trainer.init_hf_repo`` calls ``create_repo`` while the
Trainer is built, so an unreachable Hub stops the run before step 1; ``_push_from_checkpoint`` uploads the checkpoint
folder in place, which Spider's atomic save publishes by renaming and ``save_total_limit`` may delete mid-upload, with
no retry and no time bound; ``Trainer.push_to_hub`` writes Trainer's generated model card over the release's.
``run_as_future`` runs on a ``ThreadPoolExecutor``, whose worker threads the interpreter joins at exit: a request in
flight to a silent server would hold a finished run's exit until its HTTP timeout, then the queued pushes would run. This module keeps to huggingface_hub's public pieces
(``create_repo``, ``create_branch``, ``upload_folder``, ``set_client_factory``, ``validate_repo_id``) in daemon threads.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

#: Per-read/write HTTP timeout (seconds) of huggingface_hub's shared client after :func:`configure_http_timeouts`.
DEFAULT_HTTP_TIMEOUT_S = 60.0
#: Connect timeout (seconds).
DEFAULT_CONNECT_TIMEOUT_S = 10.0
#: Trainer's hub_strategy names this module supports, and where each puts checkpoint N in the repo.
HUB_STRATEGIES = ("checkpoint", "all_checkpoints")
#: 4xx statuses that may succeed on retry (timeout, conflict during concurrent commit, rate limit).
_RETRYABLE_4XX = (408, 409, 429)
#: Folder (under ``args.output_dir``) holding hard-linked snapshots of checkpoints while they upload.
STAGING_DIR_NAME = ".hub_push_staging"


@dataclass
class PushResult:
    """Outcome of one push of a local folder to a Hub repo.

    Attributes:
        ok: ``True`` when the commit was created (the files are on the Hub).
        repo_id: target repository (``"namespace/name"``).
        folder: local folder that was pushed.
        path_in_repo: folder in the repo the files went to (``""`` = repo root).
        revision: branch committed to (``None`` = the default branch).
        attempts: upload attempts made (``0`` when nothing was tried, e.g. offline mode).
        error: ``"<ExceptionType>: <message>"`` of the last failure (``None`` if ``ok``).
        commit_url: URL of the created commit (``None`` unless ``ok``).
        commit_oid: sha of the created commit (``None`` unless ``ok``).
        elapsed_s: seconds the caller waited.
        timed_out: the caller stopped waiting after ``timeout_s`` (the worker thread may still be finishing).
    """

    ok: bool
    repo_id: str
    folder: str
    path_in_repo: str = ""
    revision: str | None = None
    attempts: int = 0
    error: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None
    elapsed_s: float = 0.0
    timed_out: bool = False


# ----------------------------------------------------------------------------------------------------------- HTTP


_timeout_lock = threading.Lock()


def configure_http_timeouts(
    read_s: float = DEFAULT_HTTP_TIMEOUT_S, connect_s: float = DEFAULT_CONNECT_TIMEOUT_S, *, replace: bool = True
) -> bool:
    """Give huggingface_hub's shared HTTP client finite timeouts, so a silent server cannot block a push forever.

    Installs (``huggingface_hub.set_client_factory``) a factory that builds the library's default ``httpx2.Client``
    and sets ``timeout=httpx2.Timeout(read_s, connect=connect_s)``: ``read_s`` bounds each wait for response bytes
    and each write of request bytes, ``connect_s`` the TCP/TLS connect. Not a bound on a whole transfer (a slow but
    live upload continues). Process-wide; the first call closes the current shared client (the next request opens
    a new one). Idempotent for the same values. Every push calls it with ``replace=False``: timeouts you set with
    this function stay in force.

    Args:
        read_s: read/write/pool timeout in seconds (> 0).
        connect_s: connect timeout in seconds (> 0).
        replace: if timeouts from an earlier call are in place, replace them (``True``) or keep them (``False``).

    Returns:
        ``True`` if the timeouts are in place; ``False`` if someone else installed a client factory (left untouched:
        their client, their timeouts).

    Raises:
        ValueError: a non-positive timeout.
    """
    if not (read_s > 0 and connect_s > 0):
        raise ValueError(f"HTTP timeouts must be > 0 seconds, got read_s={read_s!r}, connect_s={connect_s!r}")
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    wanted = (float(read_s), float(connect_s))
    with _timeout_lock:
        current = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
        current_marker = getattr(current, "_spider_timeouts", None)
        if current is not _http.default_client_factory and current_marker is None:
            return False
        if current_marker == wanted or (current_marker is not None and not replace):
            return True

        def factory() -> "httpx2.Client":
            client = _http.default_client_factory()
            client.timeout = httpx2.Timeout(wanted[0], connect=wanted[1])
            return client

        factory._spider_timeouts = wanted  # type: ignore[attr-defined]
        set_client_factory(factory)
        return True


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    if len(text) > 600:
        text = text[:600] + " ..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _is_retryable(err: BaseException) -> bool:
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, (OfflineModeIsEnabled, HFValidationError, ValueError, FileNotFoundError)):
        return False  # bad input (e.g. invalid README metadata, a vanished file): the same request fails again
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status is not None and 400 <= status < 500 and status not in _RETRYABLE_4XX:
            return False
    return True


def _validate_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"repo_id must be a non-empty 'namespace/name' string, got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"invalid Hub repo_id {repo_id!r}: {err}") from err


def _check_push_args(folder: str | os.PathLike, repo_id: str, timeout_s: float, retries: int, backoff_s: float) -> Path:
    path = Path(folder)
    if not path.exists():
        raise FileNotFoundError(f"folder to push does not exist: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"folder to push is not a directory: {path}")
    _validate_repo_id(repo_id)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    if not backoff_s >= 0:
        raise ValueError(f"backoff_s must be >= 0 seconds, got {backoff_s!r}")
    return path


# ----------------------------------------------------------------------------------------------------------- push


class _Attempts:
    """State shared between the caller and the upload worker thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.attempts = 0
        self.error: str | None = None
        self.commit = None  # huggingface_hub.CommitInfo


def share_tqdm_lock() -> None:
    """Make huggingface_hub's progress bars take tqdm's own lock.

    huggingface_hub's ``tqdm`` subclass carries a lock of its own, but all bars share one instance registry. An upload
    running in a background thread then adds and removes bars while Trainer's progress bar iterates that registry
    under the other lock ("Set changed size during iteration" crashes training). One shared lock serialises them.
    """
    import tqdm as tqdm_module
    from huggingface_hub.utils import tqdm as hf_tqdm

    hf_tqdm.set_lock(tqdm_module.tqdm.get_lock())


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | bool | None = None,
    endpoint: str | None = None,
    commit_message: str,
    revision: str | None = None,
    private: bool | None = None,
    path_in_repo: str | None = None,
    ignore_patterns: list[str] | None = None,
    timeout_s: float = 60.0,
    retries: int = 3,
    backoff_s: float = 2.0,
    max_backoff_s: float = 60.0,
) -> PushResult:
    """Upload every file of ``folder`` to the Hub model repo ``repo_id`` in one commit; never raise on network errors.

    Each attempt calls ``HfApi(endpoint=endpoint, token=token).create_repo(repo_id, private=private, exist_ok=True)``,
    ``create_branch(repo_id, branch=revision, exist_ok=True)`` when a non-default ``revision`` is given, then
    ``upload_folder(folder_path=folder, path_in_repo=path_in_repo, revision=revision, ...)``. Failed attempts are
    retried (see the module docstring for which errors, the back-off and the time bound).

    Args:
        folder: local directory; its tree (sub-folders included, ``.git`` / ``.cache/huggingface`` excluded by
            huggingface_hub) is uploaded.
        repo_id: ``"namespace/name"`` (a bare ``"name"`` goes to the token's user).
        token: Hub token; ``None`` = huggingface_hub's usual lookup (``HF_TOKEN``, saved login); ``False`` = none.
        endpoint: Hub URL; ``None`` = ``HF_ENDPOINT`` or ``https://huggingface.co``.
        commit_message: commit title.
        revision: branch to commit to, created from the default branch's head if missing (``create_branch(exist_ok=
            True)``); ``None`` = the default branch.
        private: visibility if the repo is created now (an existing repo keeps its visibility); ``None`` = Hub default.
        path_in_repo: folder in the repo; ``None``/``""`` = repo root.
        ignore_patterns: glob patterns (relative to ``folder``) not to upload.
        timeout_s: longest time (seconds, > 0) this call blocks, all attempts and back-off included.
        retries: extra attempts after a failed one (>= 0): at most ``1 + retries`` attempts.
        backoff_s: sleep before the first retry (seconds); doubles each retry, capped at ``max_backoff_s``. A retry
            whose sleep would end after the ``timeout_s`` deadline is not made.
        max_backoff_s: cap of a single back-off sleep (seconds).

    Returns:
        :class:`PushResult`; ``ok=False`` with ``error`` set after a failure (also logged as a WARNING).

    Raises:
        FileNotFoundError / NotADirectoryError: ``folder`` is missing / not a directory.
        ValueError: malformed ``repo_id`` (huggingface_hub's ``validate_repo_id``), ``timeout_s <= 0``,
            ``retries < 0`` or ``backoff_s < 0``.
    """
    path = _check_push_args(folder, repo_id, timeout_s, retries, backoff_s)
    from huggingface_hub import HfApi, constants

    start = time.monotonic()
    deadline = start + timeout_s
    result = PushResult(ok=False, repo_id=repo_id, folder=str(path), path_in_repo=path_in_repo or "", revision=revision)

    if constants.is_offline_mode():
        result.error = "huggingface_hub offline mode is enabled (HF_HUB_OFFLINE=1); nothing was sent"
        logger.warning("Hub push of %s to repo %r skipped: %s. The local files are unaffected.", path, repo_id,
                       result.error)
        return result

    configure_http_timeouts(replace=False)
    api = HfApi(endpoint=endpoint, token=token)
    state = _Attempts()

    def work() -> None:
        try:
            for attempt in range(1, retries + 2):
                if state.cancel.is_set():
                    return
                with state.lock:
                    state.attempts = attempt
                try:
                    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
                    if revision is not None and revision != constants.DEFAULT_REVISION:
                        api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
                    commit = api.upload_folder(
                        repo_id=repo_id,
                        folder_path=str(path),
                        path_in_repo=path_in_repo or None,
                        commit_message=commit_message,
                        revision=revision,
                        ignore_patterns=ignore_patterns,
                        repo_type="model",
                    )
                except Exception as err:  # noqa: BLE001 -- every failure is reported, none propagates
                    with state.lock:
                        state.error = _describe(err)
                    if not _is_retryable(err) or attempt > retries:
                        return
                    delay = min(backoff_s * 2 ** (attempt - 1), max_backoff_s)
                    if time.monotonic() + delay >= deadline:
                        with state.lock:
                            state.error += f" (no retry: a {delay:.1f}s back-off would pass the {timeout_s}s limit)"
                        return
                    logger.info(
                        "Hub push to %r failed (attempt %d of %d): %s; retrying in %.1fs",
                        repo_id, attempt, retries + 1, state.error, delay,
                    )
                    if state.cancel.wait(delay):
                        return
                else:
                    with state.lock:
                        state.commit, state.error = commit, None
                    return
        finally:
            state.done.set()

    worker = threading.Thread(target=work, name=f"spider-hub-push:{repo_id}", daemon=True)
    worker.start()
    finished = state.done.wait(max(0.0, deadline - time.monotonic()))
    if not finished:
        state.cancel.set()

    with state.lock:
        result.attempts = state.attempts
        result.elapsed_s = time.monotonic() - start
        if state.commit is not None:
            result.ok = True
            result.commit_url = getattr(state.commit, "commit_url", None)
            result.commit_oid = getattr(state.commit, "oid", None)
            return result
        result.timed_out = not finished
        if result.timed_out:
            last = f"; last error: {state.error}" if state.error else ""
            result.error = f"gave up waiting after {timeout_s}s ({state.attempts} attempt(s) started{last})"
        else:
            result.error = state.error or "unknown error"
    logger.warning(
        "Hub push of %s to repo %r failed after %d attempt(s): %s. Not raised: the local files are unaffected.",
        path, repo_id, result.attempts, result.error,
    )
    return result


def push_release(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | bool | None = None,
    endpoint: str | None = None,
    commit_message: str = "Upload Spider release (weights, config, remote code, tokenizer, model card)",
    revision: str | None = None,
    private: bool | None = None,
    timeout_s: float = 900.0,
    retries: int = 3,
    backoff_s: float = 2.0,
) -> PushResult:
    """Push the final release folder to the root of ``repo_id`` (blocking, at most ``timeout_s`` seconds).

    The release folder is what ``from_pretrained(repo_id, trust_remote_code=True)`` reads: ``model.safetensors``,
    ``config.json`` (with ``auto_map``), ``configuration_spider.py`` / ``modeling_spider.py`` /
    ``tokenization_spider.py``, the tokenizer files, ``README.md`` and ``loss_curve.png``. Files already in the repo
    root that the folder lacks are kept (no deletions). Same arguments, result and failure policy as
    :func:`push_folder` (``path_in_repo`` is the root); a folder without ``config.json`` only logs a warning.

    Raises:
        FileNotFoundError / NotADirectoryError / ValueError: as :func:`push_folder`.
    """
    path = Path(folder)
    if path.is_dir() and not (path / "config.json").is_file():
        logger.warning("release folder %s has no config.json: the pushed repo will not load with from_pretrained", path)
    return push_folder(
        path, repo_id, token=token, endpoint=endpoint, commit_message=commit_message, revision=revision,
        private=private, path_in_repo=None, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
    )


# ----------------------------------------------------------------------------------------------------------- callback


def _snapshot(src: Path, dst: Path) -> None:
    """Hard-link (copy where linking fails) every file of ``src`` into ``dst``: the upload then survives Trainer's
    checkpoint rotation (``save_total_limit``) deleting ``src`` mid-upload, at no disk cost on one filesystem."""
    for item in src.rglob("*"):
        target = dst / item.relative_to(src)
        if item.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif item.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(item, target)
            except OSError:
                shutil.copy2(item, target)


class HubPushCallback(TrainerCallback):
    """``TrainerCallback`` that pushes each saved checkpoint to the Hub in the background, never stopping training.

    On ``on_save`` (world process zero only) the folder ``args.output_dir/checkpoint-{state.global_step}`` is
    snapshotted (hard links under ``args.output_dir/.hub_push_staging/``) and queued; one daemon worker thread
    uploads queued checkpoints in order with :func:`push_folder` and removes each snapshot afterwards. Where it goes
    (Trainer's ``hub_strategy`` names):

    * ``"checkpoint"`` (default): ``last-checkpoint/`` in the repo, overwritten by every push -- resume with
      ``snapshot_download(repo, allow_patterns="last-checkpoint/*")`` then ``trainer.train(resume_from_checkpoint=
      ".../last-checkpoint")``, exactly as with Trainer's own push.
    * ``"all_checkpoints"``: ``checkpoint-N/`` per save.

    While a push is queued or running, a new save is skipped (logged, step recorded in ``skipped_steps``) unless
    ``always_push=True`` (Trainer's ``hub_always_push``) -- slow uploads never pile up behind a fast save interval.

    Args:
        repo_id: ``"namespace/name"`` of the model repo (validated now, so a typo fails before training starts).
        token / endpoint / private / revision: as :func:`push_folder`.
        hub_strategy: ``"checkpoint"`` or ``"all_checkpoints"``.
        always_push: queue every save even while a push is in flight.
        timeout_s / retries / backoff_s: per checkpoint push, as :func:`push_folder` (the worker thread, not the
            training loop, waits this long).
        ignore_patterns: files of the checkpoint not to upload (e.g. ``["optimizer.pt"]`` to save bandwidth when you
            do not need to resume from the Hub).

    Attributes:
        results: one :class:`PushResult` per finished push, in order.
        skipped_steps: global steps whose save was not pushed because a push was in flight.

    Raises:
        ValueError: malformed ``repo_id``, unknown ``hub_strategy``, non-positive ``timeout_s``, negative ``retries``.
    """

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | bool | None = None,
        endpoint: str | None = None,
        private: bool | None = None,
        revision: str | None = None,
        hub_strategy: str = "checkpoint",
        always_push: bool = False,
        timeout_s: float = 1800.0,
        retries: int = 3,
        backoff_s: float = 2.0,
        ignore_patterns: list[str] | None = None,
    ):
        _validate_repo_id(repo_id)
        if hub_strategy not in HUB_STRATEGIES:
            raise ValueError(f"hub_strategy must be one of {HUB_STRATEGIES}, got {hub_strategy!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        share_tqdm_lock()
        self.repo_id = repo_id
        self.token = token
        self.endpoint = endpoint
        self.private = private
        self.revision = revision
        self.hub_strategy = hub_strategy
        self.always_push = always_push
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.ignore_patterns = ignore_patterns
        self.results: list[PushResult] = []
        self.skipped_steps: list[int] = []
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None

    # -- Trainer events --------------------------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        """Queue ``args.output_dir/checkpoint-{state.global_step}`` for upload; returns immediately."""
        if not state.is_world_process_zero:
            return
        step = state.global_step
        checkpoint = Path(args.output_dir) / f"checkpoint-{step}"
        if not checkpoint.is_dir():
            logger.warning("HubPushCallback: no checkpoint folder %s after save at step %d; nothing pushed", checkpoint, step)
            return
        with self._cond:
            if self._pending and not self.always_push:
                self.skipped_steps.append(step)
                logger.info("HubPushCallback: previous push still running; step %d not pushed", step)
                return
            self._pending += 1
        staging = Path(args.output_dir) / STAGING_DIR_NAME / checkpoint.name
        try:
            if staging.exists():
                shutil.rmtree(staging)
            _snapshot(checkpoint, staging)
            source = staging
        except OSError as err:  # snapshot is an optimisation: fall back to the live folder
            logger.warning("HubPushCallback: could not snapshot %s (%s); uploading it in place", checkpoint, err)
            shutil.rmtree(staging, ignore_errors=True)
            source = checkpoint
        path_in_repo = "last-checkpoint" if self.hub_strategy == "checkpoint" else checkpoint.name
        self._queue.put((step, source, path_in_repo, source if source == staging else None))
        self._ensure_worker()

    def on_train_end(self, args, state, control, **kwargs):
        """Does not block: logs how many pushes are still running (call :meth:`wait` to join them)."""
        with self._cond:
            pending = self._pending
        if pending and state.is_world_process_zero:
            logger.info("HubPushCallback: %d checkpoint push(es) still running; call wait() before exiting", pending)

    # -- worker ----------------------------------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        with self._cond:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="spider-hub-push-callback", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        while True:
            step, source, path_in_repo, staging = self._queue.get()
            try:
                result = push_folder(
                    source, self.repo_id, token=self.token, endpoint=self.endpoint,
                    commit_message=f"Training in progress, step {step}, checkpoint", revision=self.revision,
                    private=self.private, path_in_repo=path_in_repo, ignore_patterns=self.ignore_patterns,
                    timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s,
                )
            except Exception as err:  # noqa: BLE001 -- e.g. the folder vanished; never kill the worker
                result = PushResult(ok=False, repo_id=self.repo_id, folder=str(source), path_in_repo=path_in_repo,
                                    revision=self.revision, error=_describe(err))
                logger.warning("HubPushCallback: push of step %d failed: %s", step, result.error)
            if staging is not None and not result.timed_out:  # a timed-out upload may still be reading the files
                shutil.rmtree(staging, ignore_errors=True)
            with self._cond:
                self.results.append(result)
                self._pending -= 1
                self._cond.notify_all()

    # -- public ----------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Pushes queued or running."""
        with self._cond:
            return self._pending

    def wait(self, timeout_s: float | None = None) -> list[PushResult]:
        """Block until every queued push finished, or ``timeout_s`` seconds passed (``None``: the per-push
        ``timeout_s`` times the number of pending pushes, plus 5 s -- still bounded).

        Returns:
            a copy of :attr:`results`. Pushes still running at the deadline are left to their daemon thread and
            logged as a warning.
        """
        with self._cond:
            if timeout_s is None:
                timeout_s = self.timeout_s * max(self._pending, 1) + 5.0
            deadline = time.monotonic() + timeout_s
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning(
                        "HubPushCallback.wait: %d push(es) to %r still running after %.1fs; not waiting longer",
                        self._pending, self.repo_id, timeout_s,
                    )
                    break
                self._cond.wait(remaining)
            return list(self.results)
