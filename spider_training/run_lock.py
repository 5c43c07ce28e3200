"""One run per output directory: an exclusive lock on ``OUTPUT_DIR/.run-rank<R>.lock`` held for the life of the run.

Two runs writing checkpoints into the same folder corrupt each other's resume (they rotate, overwrite and resume from
each other's ``checkpoint-N``). :class:`RunLock` takes an OS file lock (``filelock.FileLock``: ``flock`` on POSIX) with
no waiting: the second run fails at once with :class:`RunLockedError` naming the folder and the holder's pid, host
and command line. The OS drops the lock when the holding process dies -- also on ``kill -9`` or a crash -- so a
restart after a crash is never blocked by a stale lock file (the file itself stays; only the lock matters).

Several processes of one run (DDP / FSDP) share the output directory legitimately: each takes the lock of its own
global rank, ``.run-rank<R>.lock``. A second run started on the same folder therefore fails on every one of its ranks
(rank R finds rank R's lock held), without a collective. Locks on a network filesystem work only where that
filesystem supports ``flock`` (NFSv4, Lustre with ``flock`` mount option); a local ``OUTPUT_DIR`` always does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout


class RunLockedError(RuntimeError):
    """Another live process holds the run lock of this output directory."""


def lock_path(output_dir: str | os.PathLike, rank: int = 0) -> Path:
    """``OUTPUT_DIR/.run-rank<rank>.lock``."""
    return Path(output_dir) / f".run-rank{rank}.lock"


class RunLock:
    """Exclusive, non-blocking lock of `output_dir` for global rank `rank`; a context manager.

    Args:
        output_dir: the run's output (checkpoint) directory; created if missing.
        rank: global rank of this process (``TrainingArguments.process_index``).

    Attributes:
        path: the lock file. ``path.with_suffix(".owner")`` holds JSON ``{pid, host, argv, started}`` of the holder.

    Raises (from :meth:`acquire`):
        RunLockedError: another live process holds the lock; the message names the folder and the holder.
        ValueError: a negative `rank`.
        OSError: the folder cannot be created or the lock file opened (e.g. read-only filesystem), path named.
    """

    def __init__(self, output_dir: str | os.PathLike, rank: int = 0):
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.output_dir = Path(output_dir)
        self.rank = rank
        self.path = lock_path(output_dir, rank)
        self.owner_path = self.path.with_suffix(".owner")
        # no soft (file-exists) fallback: a soft lock would outlive a killed run and block its restart
        self._lock = FileLock(str(self.path), timeout=0, fallback_to_soft=False)

    @property
    def is_locked(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> RunLock:
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(err.errno, f"cannot create output directory {self.output_dir}: {err.strerror}") from err
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            holder = ""
            try:
                info = json.loads(self.owner_path.read_text())
                holder = (
                    f" (held by pid {info.get('pid')} on {info.get('host')} since {info.get('started')}: "
                    f"{' '.join(info.get('argv', []))})"
                )
            except (OSError, ValueError):
                pass
            raise RunLockedError(
                f"another run is using output directory {self.output_dir}: lock {self.path} is held{holder}. "
                "Wait for it to finish, stop it, or choose another --ckpt_dir/--output_dir."
            ) from None
        except OSError as err:
            raise OSError(err.errno, f"cannot take the run lock {self.path}: {err.strerror}") from err
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        try:
            self.owner_path.write_text(json.dumps(owner))
        except OSError:
            pass  # informative only
        return self

    def release(self) -> None:
        """Release the lock (no-op if not held). The lock files stay; only the OS lock matters."""
        if self._lock.is_locked:
            self._lock.release(force=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
