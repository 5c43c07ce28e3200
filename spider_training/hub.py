"""Push Spider checkpoints and the final release folder to the Hugging Face Hub without ever stalling training.

Checkpoints go through ``transformers.Trainer``'s own Hub pushing (``--push_to_hub``, ``--hub_model_id``,
``--hub_strategy``, ``--hub_always_push``, ``--hub_revision``, ``--hub_private_repo``, ``--hub_token``), with the two
overrides an offline-tolerant run needs (:class:`HubPushMixin`); the uploads themselves are this module's:

* :func:`push_folder` -- one bounded, never-raising upload of a local folder (``create_repo(exist_ok=True)`` +
  ``HfApi.upload_folder``) with retries and exponential back-off; returns a :class:`PushResult`.
* :class:`HubPushMixin` -- mixed into ``SpiderTrainer``: ``init_hf_repo`` sends nothing (Trainer's would stop an
  offline run before step 1), and each checkpoint Trainer pushes is uploaded from a hard-linked snapshot with
  :func:`push_folder` in a background thread, so training goes on while it uploads.
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

Trainer integration (``spider_training/train.py``)::

    trainer = SpiderTrainer(..., args=args, hub_endpoint=...)   # args.push_to_hub=True, hub_model_id=...
    trainer.train()                                             # checkpoints pushed in the background
    write release folder ...
    result = push_release(release_dir, trainer.hub_model_id, token=args.hub_token)
    # result.ok is False offline; the release is on disk either way

Only the process with ``is_world_process_zero()`` pushes.

What of Trainer's pushing is replaced, and why (checked against transformers 5.24 / huggingface_hub 2.4):
``Trainer.init_hf_repo`` calls ``create_repo`` while the Trainer is built, so an unreachable Hub would stop the run
before step 1. ``_push_from_checkpoint`` uploads with ``HfApi.upload_folder(run_as_future=True)`` from the
checkpoint folder itself, which ``save_total_limit`` may delete mid-upload, with no retry and no time bound, and a
failed future is never reported. ``Trainer.push_to_hub`` would write Trainer's generated model card over the
release's, so the release goes up with :func:`push_release`.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_utils import HubStrategy
from transformers.utils.hub import PushInProgress

logger = logging.getLogger(__name__)

#: Per-read/write HTTP timeout (seconds) of huggingface_hub's shared client after :func:`configure_http_timeouts`.
DEFAULT_HTTP_TIMEOUT_S = 60.0
#: Connect timeout (seconds).
DEFAULT_CONNECT_TIMEOUT_S = 10.0
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


# ----------------------------------------------------------------------------------------------------------- Trainer


#: Files of a checkpoint that only resuming needs. Trainer pushes a checkpoint's model files (weights, config,
#: tokenizer, code, ``training_args.bin``) to the repo root; these go only into ``last-checkpoint/``
#: (``checkpoint-N/``).
RESUME_STATE_PATTERNS = ("optimizer*", "scheduler*", "scaler*", "rng_state*", "trainer_state.json")


def _snapshot(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Hard-link (copy where linking fails) every file of ``src`` into ``dst``, except top-level names matching a
    pattern of ``skip``: the upload then survives Trainer's checkpoint rotation (``save_total_limit``) deleting ``src``
    mid-upload, at no disk cost on one filesystem."""
    for item in src.rglob("*"):
        relative = item.relative_to(src)
        if any(fnmatch.fnmatch(relative.parts[0], pattern) for pattern in skip):
            continue
        target = dst / relative
        if item.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif item.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(item, target)
            except OSError:
                shutil.copy2(item, target)


class AbandonablePushInProgress(PushInProgress):
    """Trainer's record of the checkpoint pushes in flight (``Trainer.push_in_progress``, which ``train()`` waits for
    at its end), except that it does not wait once ``abandon()`` says so: a run stopped by SIGTERM must exit within
    its grace period. Every job finishes on its own within the push's time bound (:func:`push_folder`)."""

    def __init__(self, jobs: list[futures.Future], abandon) -> None:
        super().__init__(jobs)
        self.abandon = abandon

    def wait_until_done(self) -> None:
        if self.abandon():
            pending = sum(not job.done() for job in self.jobs)
            if pending:
                logger.warning("%d Hub push(es) still running; not waiting for them (the run was stopped)", pending)
            return
        super().wait_until_done()


class HubPushMixin:
    """Trainer's own Hub pushing, made safe for a run whose Hub is unreachable. Mix it in before ``Trainer``
    (``class MyTrainer(HubPushMixin, Trainer)``).

    Trainer's machinery drives it: ``args.push_to_hub`` switches it on; ``hub_model_id``, ``hub_token``,
    ``hub_private_repo``, ``hub_revision``, ``hub_strategy`` and ``hub_always_push`` mean what Trainer's docs say;
    the ``on_push_begin`` callback event fires; Trainer skips nothing it would not skip; ``train()`` waits at its end
    for the pushes in flight (``push_in_progress``). Two of Trainer's methods change:

    * ``init_hf_repo`` (public; Trainer calls it while it is built): checks the repo id
      (``huggingface_hub.utils.validate_repo_id``, ``ValueError`` when malformed) and sends nothing, so an
      unreachable Hub cannot stop the run before step 1; every push creates the repo if it is missing.
    * ``_push_from_checkpoint`` (private: Trainer calls it from ``_save_checkpoint`` after each save, and no public
      hook runs there): the same files to the same places as Trainer -- the checkpoint's model files (all but
      :data:`RESUME_STATE_PATTERNS`) to the repo root, and with ``hub_strategy="checkpoint"`` the whole checkpoint to
      ``last-checkpoint/`` (``"all_checkpoints"``: ``checkpoint-N/``; ``"end"``: nothing during training) -- but in
      one commit ("Training in progress, step N"; Trainer makes two), uploaded from a hard-linked snapshot under
      ``OUTPUT_DIR/.hub_push_staging/`` (checkpoint rotation cannot pull files from under an upload) by
      :func:`push_folder` in a daemon thread: retried with back-off, bounded in time, failures logged as warnings,
      never raised into training. With ``hub_always_push`` the pushes land in order (the newest model last).

    Settings (attributes; set them before ``Trainer.__init__`` runs, e.g. in the subclass's ``__init__``):
    ``hub_endpoint`` (None: ``HF_ENDPOINT`` or huggingface.co), ``hub_push_timeout_s`` (per checkpoint push, seconds),
    ``hub_push_retries``, ``hub_push_backoff_s``. Results: ``hub_push_results`` (one :class:`PushResult` per finished
    checkpoint push, in order), ``hub_skipped_steps`` (saves not pushed because a push was still in flight).
    """

    hub_endpoint: str | None = None
    hub_push_timeout_s: float = 1800.0
    hub_push_retries: int = 3
    hub_push_backoff_s: float = 2.0

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Set ``hub_model_id`` (``args.hub_model_id``, else the output folder's name, as Trainer) without contacting
        the Hub. Raises ``ValueError`` for a malformed repo id."""
        self.hub_push_results: list[PushResult] = []
        self.hub_skipped_steps: list[int] = []
        self.push_in_progress = None
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        _validate_repo_id(repo_id)
        self.hub_model_id = repo_id
        share_tqdm_lock()

    def hub_pushes_abandoned(self) -> bool:
        """Whether the end of ``train()`` should leave pushes in flight to their threads (default: never)."""
        return False

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        step = self.state.global_step
        busy = self.push_in_progress is not None and not self.push_in_progress.is_done()
        if busy and not self.args.hub_always_push:
            self.hub_skipped_steps.append(step)
            logger.info("previous Hub push still running; checkpoint of step %d not pushed", step)
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        # The repo's layout after this commit, as Trainer's two commits leave it: the model files at the root and,
        # with hub_strategy "checkpoint" / "all_checkpoints", the whole checkpoint in last-checkpoint/ / checkpoint-N/.
        checkpoint = Path(checkpoint_folder)
        snapshot = Path(self.args.output_dir) / STAGING_DIR_NAME / checkpoint.name
        shutil.rmtree(snapshot, ignore_errors=True)
        try:
            _snapshot(checkpoint, snapshot, skip=RESUME_STATE_PATTERNS)
            if self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
                folder = "last-checkpoint" if self.args.hub_strategy == HubStrategy.CHECKPOINT else checkpoint.name
                _snapshot(checkpoint, snapshot / folder)
        except OSError as err:
            shutil.rmtree(snapshot, ignore_errors=True)
            self.hub_push_results.append(PushResult(ok=False, repo_id=self.hub_model_id, folder=str(checkpoint),
                                                    error=_describe(err)))
            logger.warning("checkpoint of step %d not pushed: could not snapshot %s (%s)", step, checkpoint, err)
            return
        job: futures.Future = futures.Future()
        previous = self.push_in_progress.jobs[-1] if busy else None  # pushes land in order: the newest model last
        threading.Thread(target=self._push_snapshot, args=(job, snapshot, step, previous),
                         name=f"spider-hub-push:{step}", daemon=True).start()
        if busy:
            self.push_in_progress.jobs.append(job)
        else:
            self.push_in_progress = AbandonablePushInProgress([job], self.hub_pushes_abandoned)

    def _push_snapshot(self, job: futures.Future, snapshot: Path, step: int, previous: futures.Future | None) -> None:
        if previous is not None:
            futures.wait([previous])  # bounded: every push ends within its own time limit
        try:
            result = push_folder(
                snapshot, self.hub_model_id, token=self.args.hub_token, endpoint=self.hub_endpoint,
                commit_message=f"Training in progress, step {step}", revision=self.args.hub_revision,
                private=self.args.hub_private_repo, timeout_s=self.hub_push_timeout_s, retries=self.hub_push_retries,
                backoff_s=self.hub_push_backoff_s,
            )
        except Exception as err:  # noqa: BLE001 -- e.g. the snapshot vanished; a push never raises into training
            result = PushResult(ok=False, repo_id=self.hub_model_id, folder=str(snapshot), error=_describe(err))
            logger.warning("Hub push of the checkpoint of step %d failed: %s", step, result.error)
        if not result.timed_out:  # a timed-out upload may still be reading the files
            shutil.rmtree(snapshot, ignore_errors=True)
        self.hub_push_results.append(result)
        job.set_result(result)
