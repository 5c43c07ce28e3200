"""Push Spider checkpoints and the release folder to the Hugging Face Hub without ever stopping or stalling training.

The uploads are huggingface_hub's (``HfApi.create_repo(exist_ok=True)``, ``create_branch``, ``upload_folder``, with
the library's own retries of LFS transfers and 408/429/5xx answers). Added here, only what an offline-tolerant run
needs and the library lacks:

* a bounded wait: :func:`push_folder` uploads in a daemon thread and waits at most ``timeout_s`` seconds; a failure
  is a :class:`PushResult` with ``ok=False`` and one WARNING on this module's logger, never an exception.
  (``HfApi.run_as_future``'s thread pool is not daemon: a hung upload would hold the process at exit, past a
  SIGTERM grace period.) An upload that finishes after the caller stopped waiting still lands.
* HTTP timeouts: the shared client (``huggingface_hub.get_session()``) has none and upload calls pass none, so a
  server that never answers holds a request forever (``HF_HUB_ETAG_TIMEOUT`` / ``HF_HUB_DOWNLOAD_TIMEOUT`` cover
  downloads only): every push calls :func:`configure_http_timeouts`. Xet transfers are bounded by ``timeout_s`` only.
* :class:`HubPushMixin` for ``transformers.Trainer``: ``init_hf_repo`` contacts nothing (Trainer's would stop an
  offline run before step 1); checkpoints go up in the background from hard-linked snapshots (Trainer uploads from
  the checkpoint folder, which ``save_total_limit`` may delete mid-upload); only world process zero pushes.
  :func:`push_release` sends the release folder (``Trainer.push_to_hub`` would overwrite its model card).

Bad local input raises before anything is sent. With ``HF_HUB_OFFLINE=1`` huggingface_hub refuses every request.
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

#: Per-read/write and connect HTTP timeouts (seconds) that :func:`configure_http_timeouts` sets by default.
DEFAULT_HTTP_TIMEOUT_S, DEFAULT_CONNECT_TIMEOUT_S = 60.0, 10.0
#: Folder (under ``args.output_dir``) holding hard-linked snapshots of checkpoints while they upload.
STAGING_DIR_NAME = ".hub_push_staging"
#: Checkpoint files only resuming needs: pushed into ``last-checkpoint/`` (``checkpoint-N/``), not to the repo root.
RESUME_STATE_PATTERNS = ("optimizer*", "scheduler*", "scaler*", "rng_state*", "trainer_state.json")


@dataclass
class PushResult:
    """Outcome of one push of local ``folder`` to ``repo_id`` (under ``path_in_repo``, ``""`` = root; on branch
    ``revision``, ``None`` = default). ``ok``: the commit was created (``commit_url``, ``commit_oid`` set); else
    ``error`` is ``"<ExceptionType>: <message>"``. ``elapsed_s``: seconds the caller waited; ``timed_out``: it stopped
    waiting after ``timeout_s`` (the upload thread may still be finishing)."""

    ok: bool
    repo_id: str
    folder: str
    path_in_repo: str = ""
    revision: str | None = None
    error: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None
    elapsed_s: float = 0.0
    timed_out: bool = False


def configure_http_timeouts(
    read_s: float = DEFAULT_HTTP_TIMEOUT_S, connect_s: float = DEFAULT_CONNECT_TIMEOUT_S, *, replace: bool = True
) -> bool:
    """Set finite timeouts on huggingface_hub's shared HTTP client (``huggingface_hub.get_session()``).

    ``read_s`` (seconds, > 0) bounds each wait for response bytes and each write of request bytes (and the pool wait),
    ``connect_s`` (seconds, > 0) the TCP/TLS connect; neither bounds a whole transfer. Process-wide, downloads
    included. A new client (after ``close_session`` / ``set_client_factory``) has none: every push calls this with
    ``replace=False``, which keeps finite timeouts already set (yours or an earlier call's).

    Returns:
        ``True`` if these timeouts are now in force; ``False`` if the client's own finite ones were kept.

    Raises:
        ValueError: a non-positive timeout.
    """
    if not (read_s > 0 and connect_s > 0):
        raise ValueError(f"HTTP timeouts must be > 0 seconds, got read_s={read_s!r}, connect_s={connect_s!r}")
    import httpx2
    from huggingface_hub import get_session

    session = get_session()
    if not replace and session.timeout.read is not None:
        return session.timeout.read == read_s and session.timeout.connect == connect_s
    session.timeout = httpx2.Timeout(float(read_s), connect=float(connect_s))
    return True


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:600]}".rstrip(": ")


def in_daemon_thread(fn, *args, name: str = "spider-hub-push", **kwargs) -> futures.Future:
    """Run ``fn(*args, **kwargs)`` in a new daemon thread (it never holds the process at exit); return its Future."""
    job: futures.Future = futures.Future()

    def run() -> None:
        try:
            job.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 -- handed to whoever reads the Future
            job.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return job


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    commit_message: str,
    token: str | bool | None = None,
    endpoint: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
    path_in_repo: str | None = None,
    ignore_patterns: list[str] | None = None,
    timeout_s: float = 60.0,
) -> PushResult:
    """Upload every file of ``folder`` to the Hub model repo ``repo_id`` in one commit; never raise on network errors.

    ``HfApi(endpoint, token).create_repo(repo_id, private=private, exist_ok=True)``, ``create_branch(exist_ok=True)``
    for a non-default ``revision`` (created from the default branch), then ``upload_folder`` of ``folder``'s tree
    (without ``ignore_patterns``) into ``path_in_repo`` (``None``/``""``: the root), in a daemon thread that this call
    waits for at most ``timeout_s`` seconds (> 0). ``token``: ``None`` = huggingface_hub's lookup (``HF_TOKEN``, saved
    login), ``False`` = none; ``endpoint``: ``None`` = ``HF_ENDPOINT`` or huggingface.co; ``private``: visibility of
    a repo created now (``None``: the Hub's default).

    Returns:
        :class:`PushResult`; ``ok=False`` with ``error`` set after a failure (also logged as a WARNING).

    Raises:
        FileNotFoundError / NotADirectoryError: ``folder`` is missing / not a directory.
        ValueError: ``timeout_s <= 0``, or a malformed ``repo_id`` (``HFValidationError`` from huggingface_hub's
            ``validate_repo_id``).
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import validate_repo_id

    path = Path(folder)
    if not path.exists():
        raise FileNotFoundError(f"folder to push does not exist: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"folder to push is not a directory: {path}")
    validate_repo_id(repo_id)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")

    start = time.monotonic()
    result = PushResult(
        ok=False, repo_id=repo_id, folder=str(path), path_in_repo=path_in_repo or "", revision=revision
    )
    configure_http_timeouts(replace=False)
    api = HfApi(endpoint=endpoint, token=token)

    def upload():
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None and revision != constants.DEFAULT_REVISION:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=str(path),
            path_in_repo=path_in_repo or None,
            commit_message=commit_message,
            revision=revision,
            ignore_patterns=ignore_patterns,
            repo_type="model",
        )

    try:
        commit = in_daemon_thread(upload, name=f"spider-hub-push:{repo_id}").result(timeout=timeout_s)
    except futures.TimeoutError:
        result.timed_out, result.error = True, f"gave up waiting after {timeout_s}s (the upload goes on in its thread)"
    except Exception as err:  # noqa: BLE001 -- every failure is reported, none propagates
        result.error = _describe(err)
    else:
        result.ok, result.commit_url, result.commit_oid = True, commit.commit_url, commit.oid
    result.elapsed_s = time.monotonic() - start
    if not result.ok:
        logger.warning(
            "Hub push of %s to repo %r failed: %s. Not raised: the local files are unaffected.",
            path,
            repo_id,
            result.error,
        )
    return result


def push_release(folder: str | os.PathLike, repo_id: str, *, timeout_s: float = 900.0, **kwargs) -> PushResult:
    """Push the release folder (what ``from_pretrained(repo_id, trust_remote_code=True)`` reads: weights, config with
    ``auto_map``, remote-code ``.py`` files, tokenizer files, README model card, loss curve) to the root of
    ``repo_id``, blocking at most ``timeout_s`` seconds; files in the repo that the folder lacks are kept. ``kwargs``,
    result and exceptions as :func:`push_folder`; a folder without ``config.json`` only logs a warning."""
    if Path(folder).is_dir() and not (Path(folder) / "config.json").is_file():
        logger.warning(
            "release folder %s has no config.json: the pushed repo will not load with from_pretrained", folder
        )
    kwargs.setdefault("commit_message", "Upload Spider release (weights, config, remote code, tokenizer, model card)")
    return push_folder(folder, repo_id, timeout_s=timeout_s, **kwargs)


def _snapshot(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Hard-link (else copy) ``src``'s tree into ``dst``, leaving out top-level names that match ``skip``."""

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if Path(folder) == src and any(fnmatch.fnmatch(n, p) for p in skip)]

    shutil.copytree(src, dst, ignore=ignore, copy_function=link, dirs_exist_ok=True)


class AbandonablePushInProgress(PushInProgress):
    """Trainer's record of the pushes in flight (``Trainer.push_in_progress``, waited for at the end of ``train()``),
    except that it does not wait once ``abandon()`` is true: a run stopped by SIGTERM must exit within its grace
    period. Each job ends on its own within the push's ``timeout_s``."""

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
    """Trainer's own Hub pushing, safe for a run whose Hub is unreachable: ``class T(HubPushMixin, Trainer)``.

    Trainer's ``push_to_hub``/``hub_*`` arguments and ``on_push_begin`` event keep their meaning. ``init_hf_repo``
    checks the repo id (``ValueError``) and sends nothing. ``_push_from_checkpoint`` (private; no public hook runs
    after a save) sends what Trainer's two commits send -- model files (not :data:`RESUME_STATE_PATTERNS`) to the
    root; with ``hub_strategy`` ``"checkpoint"``/``"all_checkpoints"`` the checkpoint to ``last-checkpoint/`` /
    ``checkpoint-N/`` -- in one commit ("Training in progress, step N"), from a snapshot under
    ``OUTPUT_DIR/.hub_push_staging/``, through :func:`push_folder` in a daemon thread. A save made while a push is in
    flight is skipped, unless ``hub_always_push`` (pushes then land in order, the newest model last).

    Settings (set before ``Trainer.__init__``): ``hub_endpoint`` (None: ``HF_ENDPOINT`` or huggingface.co),
    ``hub_push_timeout_s`` (seconds per push). Results: ``hub_push_results`` (a :class:`PushResult` per finished
    push, in order), ``hub_skipped_steps`` (saves not pushed because a push was in flight).
    """

    hub_endpoint: str | None = None
    hub_push_timeout_s: float = 1800.0

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Set ``hub_model_id`` (``args.hub_model_id``, else the output folder's name, as Trainer) without contacting
        the Hub. Raises ``ValueError`` for a malformed repo id."""
        self.hub_push_results: list[PushResult] = []
        self.hub_skipped_steps: list[int] = []
        self.push_in_progress: AbandonablePushInProgress | None = None
        import tqdm
        from huggingface_hub.utils import tqdm as hf_tqdm
        from huggingface_hub.utils import validate_repo_id

        repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
        validate_repo_id(repo_id)
        self.hub_model_id = repo_id
        # huggingface_hub's tqdm has a lock of its own but shares tqdm's registry of bars: an upload's bars added while
        # Trainer's bar iterates the registry crash training ("Set changed size during iteration"). Share one lock.
        hf_tqdm.set_lock(tqdm.tqdm.get_lock())

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
            self.hub_push_results.append(
                PushResult(ok=False, repo_id=self.hub_model_id, folder=str(checkpoint), error=_describe(err))
            )
            logger.warning("checkpoint of step %d not pushed: could not snapshot %s (%s)", step, checkpoint, err)
            return
        previous = self.push_in_progress.jobs[-1] if busy else None
        job = in_daemon_thread(self._push_snapshot, snapshot, step, previous, name=f"spider-hub-push:{step}")
        if busy:
            self.push_in_progress.jobs.append(job)
        else:  # Trainer waits for these at the end of train()
            self.push_in_progress = AbandonablePushInProgress([job], self.hub_pushes_abandoned)

    def _push_snapshot(self, snapshot: Path, step: int, previous: futures.Future | None) -> PushResult:
        if previous is not None:
            futures.wait([previous])  # bounded: every push ends within its own time limit
        try:
            result = push_folder(
                snapshot,
                self.hub_model_id,
                token=self.args.hub_token,
                endpoint=self.hub_endpoint,
                commit_message=f"Training in progress, step {step}",
                revision=self.args.hub_revision,
                private=self.args.hub_private_repo,
                timeout_s=self.hub_push_timeout_s,
            )
        except Exception as err:  # noqa: BLE001 -- e.g. the snapshot vanished; a push never raises into training
            result = PushResult(ok=False, repo_id=self.hub_model_id, folder=str(snapshot), error=_describe(err))
            logger.warning("Hub push of the checkpoint of step %d failed: %s", step, result.error)
        if not result.timed_out:  # a timed-out upload may still be reading the files
            shutil.rmtree(snapshot, ignore_errors=True)
        self.hub_push_results.append(result)
        return result
