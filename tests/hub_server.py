"""``FakeHubServer``: a local HTTP **test double** of the Hugging Face Hub, for tests that push without a network.

The Hub cannot be reached on the development machine or in CI, so the upload code in ``spider_training/hub.py`` is
tested against this server: the real ``huggingface_hub.HfApi`` (2.4) talks HTTP to ``http://127.0.0.1:<port>``
(``HfApi(endpoint=server.url)``) and this server answers the requests that ``create_repo`` + ``upload_folder`` make
on the plain-HTTP ("LFS") path. The endpoints, in the order one ``upload_folder`` of a folder with a ``README.md``, a
small ``config.json`` and a 1 MB ``model.safetensors`` calls them (measured by logging the requests it made):

====  ==========================================================  =================================================
1     ``POST /api/repos/create``                                  ``{"name", "organization", "type"?, "visibility"?}``
                                                                  -> 200 ``{"url"}``; 409 (same body) if it exists
2     ``POST /api/validate-yaml``                                 README front matter check -> ``{"errors",
"warnings"}``
3     ``POST /api/models/<ns>/<name>/preupload/<rev>``            per file: ``uploadMode`` ``"regular"`` | ``"lfs"``
4     ``POST /<ns>/<name>.git/info/lfs/objects/batch``            git-LFS batch API: an upload + verify URL per object
5     ``PUT  /_fake_lfs/upload/<sha256>``                         the LFS blob (sha256 checked against the URL)
6     ``POST /_fake_lfs/verify``                                  ``{"oid", "size"}`` -> 200 if stored
7     ``POST /api/models/<ns>/<name>/commit/<rev>``               ndjson: header, ``file`` (base64) / ``lfsFile``
                                                                  (oid) / ``deletedFile`` lines -> ``{"commitUrl",
                                                                  "commitOid"}``
(1b)  ``POST /api/models/<ns>/<name>/branch/<branch>``            ``create_branch`` (``{"startingPoint"?}``; 409 if
                                                                  it exists), made when a push names a ``revision``
====  ==========================================================  =================================================

A file is stored as LFS ("lfs" upload mode) when it is at least ``lfs_threshold`` bytes (the Hub's 10 MiB), has an
extension the Hub's default ``.gitattributes`` tracks with LFS (``.safetensors``, ``.bin``, ``.pt``, ...), or its
first 512 bytes contain a NUL byte (binary; a PNG always does) -- the same outcome the real Hub gives.

**Xet is not spoken.** With ``hf_xet`` installed (the default), huggingface_hub 2.4 uploads LFS files through the Xet
content-addressed storage protocol (``GET .../xet-write-token/<rev>`` then a binary chunk protocol to a CAS server),
and ``upload_folder`` uses its Xet pipeline; there is no way for a server to ask for the plain path instead. Tests
must therefore disable Xet on the client: ``monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET",
True)`` (what ``HF_HUB_DISABLE_XET=1`` in the environment does at import time). A Xet token request gets a 501 that
says so.

Failure modes (``mode``, changeable while running): ``"ok"``; ``"error500"`` -- every request gets HTTP 500;
``"hang"`` -- the server reads the request and never answers: the handler waits until the server is closed (or
``hang_s`` passed), then drops the connection without a response. ``fail_first=N`` answers the first N requests with
500 (with ``fail_path="/x"``: the first N whose path starts with ``/x``) and then behaves as ``mode``.
``token="hf_..."`` makes every API request without ``Authorization: Bearer <token>``
fail with 401.

Only loopback: the server binds ``127.0.0.1`` (port 0 = a free port chosen by the OS); a non-loopback ``host``
raises ``ValueError``. Use it as a context manager; ``close()`` releases hanging handlers, stops the serving thread
and closes the socket, so nothing outlives the test (a client still waiting on a hung request sees the connection
closed).

Inspect what arrived with ``server.files(repo_id)`` (path -> bytes at the head of a branch), ``server.repos``,
``server.commits`` and ``server.requests`` (every request: method, path, query, headers, body size, status).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import ipaddress
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

MODES = ("ok", "error500", "hang")

# Extensions the Hub's default .gitattributes stores with git-LFS (subset that matters for model repos).
LFS_EXTENSIONS = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".onnx",
    ".msgpack",
    ".npy",
    ".npz",
    ".pkl",
    ".pickle",
    ".gz",
    ".zip",
    ".zst",
    ".tar",
    ".tflite",
    ".ot",
    ".model",
    ".arrow",
    ".parquet",
    ".joblib",
)


@dataclass
class RecordedRequest:
    """One request the fake Hub received. ``status`` is the HTTP status it answered (``None`` if it hung)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body_size: int
    status: int | None = None
    time: float = field(default_factory=time.monotonic)


@dataclass
class FakeRepo:
    """A repository of the fake Hub: ``branches[rev][path] = content`` (bytes)."""

    repo_id: str
    repo_type: str
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})


@dataclass
class FakeCommit:
    """A commit the fake Hub accepted."""

    repo_id: str
    revision: str
    oid: str
    summary: str
    added: list[str]
    deleted: list[str]


class _HubError(Exception):
    """Raised inside a handler to answer ``status`` with a JSON error (and optional ``X-Error-Code``)."""

    def __init__(self, status: int, message: str, error_code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code, self.extra = status, message, error_code, extra or {}


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True  # a handler stuck in "hang" never blocks interpreter exit
    allow_reuse_address = True
    fake: FakeHubServer


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr access log
        return

    # every method goes through one dispatcher
    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self) -> None:
        fake = self.server.fake
        parsed = urllib.parse.urlsplit(self.path)
        body = self._read_body()
        record = RecordedRequest(
            method=self.command,
            path=parsed.path,
            query=urllib.parse.parse_qs(parsed.query),
            headers={k.lower(): v for k, v in self.headers.items()},
            body_size=len(body),
        )
        with fake._lock:
            fake.requests.append(record)
            mode = fake.mode
            if record.path.startswith(fake.fail_path) and fake._failed < fake.fail_first:
                fake._failed += 1
                mode = "error500"
        if mode == "hang":
            # Never answer: hold the connection until the server closes (or hang_s passes), then drop it.
            fake._release.wait(fake.hang_s)
            self.close_connection = True
            return
        try:
            if mode == "error500":
                raise _HubError(500, "FakeHubServer: injected internal server error (mode='error500')")
            fake._check_auth(record)
            status, payload = fake._route(self.command, parsed.path, record.query, body)
        except _HubError as err:
            status, payload = err.status, {"error": err.message, **err.extra}
            self._send(status, payload, error_code=err.error_code)
        except Exception as err:  # a bug in the fake: answer 500 with the reason, keep serving
            status, payload = 500, {"error": f"FakeHubServer crashed on {self.command} {parsed.path}: {err!r}"}
            self._send(status, payload)
        else:
            self._send(status, payload)
        record.status = status

    def _send(self, status: int, payload: Any, error_code: str | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", str(payload.get("error", ""))[:200])
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class FakeHubServer:
    """Local test double of the Hub's upload API (see the module docstring for the endpoints).

    Args:
        mode: ``"ok"`` | ``"error500"`` | ``"hang"``; may be reassigned while the server runs.
        fail_first: answer the first ``fail_first`` requests with HTTP 500, then behave as ``mode``.
        fail_path: only requests whose path starts with this prefix count for ``fail_first`` (``""``: all).
        hang_s: longest time a ``"hang"`` handler holds a connection (seconds) before dropping it.
        token: if set, API requests must carry ``Authorization: Bearer <token>`` (else 401).
        lfs_threshold: files of at least this many bytes are uploaded as LFS (bytes; the Hub uses 10 MiB).
        host: bind address; must be a loopback address.

    Raises:
        ValueError: unknown ``mode``, negative ``fail_first``/``hang_s``, or a non-loopback ``host``.
    """

    def __init__(
        self,
        mode: str = "ok",
        *,
        fail_first: int = 0,
        fail_path: str = "",
        hang_s: float = 30.0,
        token: str | None = None,
        lfs_threshold: int = 10 * 1024 * 1024,
        host: str = "127.0.0.1",
    ):
        if mode not in MODES:
            raise ValueError(f"FakeHubServer mode must be one of {MODES}, got {mode!r}")
        if fail_first < 0 or hang_s < 0:
            raise ValueError(f"fail_first and hang_s must be >= 0, got {fail_first}, {hang_s}")
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"FakeHubServer binds loopback addresses only, got host={host!r}")
        self.mode = mode
        self.fail_first = fail_first
        self.fail_path = fail_path
        self._failed = 0
        self.hang_s = hang_s
        self.token = token
        self.lfs_threshold = lfs_threshold
        self.host = host
        self.requests: list[RecordedRequest] = []
        self.repos: dict[str, FakeRepo] = {}
        self.commits: list[FakeCommit] = []
        self.lfs_blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeHubServer:
        """Bind ``host:0`` and serve in a daemon thread. Returns ``self``."""
        if self._httpd is not None:
            raise RuntimeError("FakeHubServer already started")
        self._httpd = _Server((self.host, 0), _Handler)
        self._httpd.fake = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="FakeHubServer", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Release hanging handlers, stop serving, close the socket. Idempotent."""
        self._release.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("FakeHubServer is not running")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        """Base URL to pass as ``endpoint`` (``http://127.0.0.1:<port>``)."""
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ inspection
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Files at the head of ``revision`` of ``repo_id``: ``{path_in_repo: content}``. KeyError if unknown."""
        with self._lock:
            return dict(self.repos[repo_id].branches[revision])

    def count(self, method: str, path_suffix: str) -> int:
        """Number of received requests with this method whose path ends with ``path_suffix``."""
        with self._lock:
            return sum(1 for r in self.requests if r.method == method and r.path.endswith(path_suffix))

    # ------------------------------------------------------------------ request handling
    def _check_auth(self, record: RecordedRequest) -> None:
        if self.token is None or record.path.startswith("/_fake_lfs/"):
            return  # LFS upload URLs are pre-signed on the real Hub too
        if record.headers.get("authorization") != f"Bearer {self.token}":
            raise _HubError(401, "FakeHubServer: invalid or missing token", error_code=None)

    def _repo(self, repo_id: str) -> FakeRepo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _HubError(404, f"Repository not found: {repo_id}", error_code="RepoNotFound")
        return repo

    def _route(self, method: str, path: str, query: dict, body: bytes) -> tuple[int, Any]:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(json.loads(body or b"{}"))
        if method == "POST" and path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(body or b"{}"))
        if method == "PUT" and parts[:2] == ["_fake_lfs", "upload"] and len(parts) == 3:
            return self._lfs_put(parts[2], body)
        if method == "POST" and path == "/_fake_lfs/verify":
            return self._lfs_verify(json.loads(body or b"{}"))
        if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            repo_path = path[1 : -len(".git/info/lfs/objects/batch")]
            for prefix in ("datasets/", "spaces/"):
                repo_path = repo_path.removeprefix(prefix)
            return self._lfs_batch(repo_path, json.loads(body or b"{}"))
        # /api/{type}s/{ns}/{name}/{action}/{revision}
        if len(parts) == 6 and parts[0] == "api" and parts[1] in ("models", "datasets", "spaces"):
            repo_id, action, revision = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            if method == "POST" and action == "preupload":
                return self._preupload(repo_id, revision, json.loads(body or b"{}"))
            if method == "POST" and action == "commit":
                return self._commit(repo_id, revision, body)
            if method == "POST" and action == "branch":
                return self._create_branch(repo_id, revision, json.loads(body or b"{}"))
            if action == "xet-write-token":
                raise _HubError(
                    501,
                    "FakeHubServer does not speak the Xet protocol: disable Xet on the client "
                    "(HF_HUB_DISABLE_XET=1 / huggingface_hub.constants.HF_HUB_DISABLE_XET = True)",
                )
        raise _HubError(404, f"FakeHubServer: unsupported endpoint {method} {path}")

    def _create_repo(self, payload: dict) -> tuple[int, Any]:
        name, organization = payload.get("name"), payload.get("organization")
        if not name:
            raise _HubError(400, "FakeHubServer: create needs a 'name'")
        repo_id = f"{organization}/{name}" if organization else f"user/{name}"
        url = f"{self.url}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                raise _HubError(409, "You already created this model repo", extra={"url": url})
            self.repos[repo_id] = FakeRepo(
                repo_id=repo_id,
                repo_type=payload.get("type") or "model",
                private=payload.get("visibility") == "private" or bool(payload.get("private")),
            )
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    def _create_branch(self, repo_id: str, branch: str, payload: dict) -> tuple[int, Any]:
        repo = self._repo(repo_id)
        start = payload.get("startingPoint") or "main"
        with self._lock:
            if branch in repo.branches:
                raise _HubError(409, f"Reference already exists: refs/heads/{branch}")
            if start not in repo.branches:
                raise _HubError(404, f"Invalid rev id: {start}", error_code="RevisionNotFound")
            repo.branches[branch] = dict(repo.branches[start])
        return 200, {}

    def _validate_yaml(self, payload: dict) -> tuple[int, Any]:
        import yaml

        content = payload.get("content", "")
        if content.startswith("---"):
            front = content.split("---", 2)[1] if content.count("---") >= 2 else ""
            try:
                meta = yaml.safe_load(front)
            except yaml.YAMLError as err:
                raise _HubError(400, "Invalid YAML", extra={"errors": [{"message": str(err)}]})
            if meta is not None and not isinstance(meta, dict):
                raise _HubError(400, "Invalid YAML", extra={"errors": [{"message": "metadata must be a mapping"}]})
        return 200, {"errors": [], "warnings": []}

    def _upload_mode(self, path: str, size: int, sample: bytes) -> str:
        if size >= self.lfs_threshold or path.lower().endswith(LFS_EXTENSIONS) or b"\x00" in sample:
            return "lfs"
        return "regular"

    def _preupload(self, repo_id: str, revision: str, payload: dict) -> tuple[int, Any]:
        repo = self._repo(repo_id)
        if revision not in repo.branches:
            raise _HubError(404, f"Invalid rev id: {revision}", error_code="RevisionNotFound")
        files = []
        for f in payload.get("files", []):
            sample = base64.b64decode(f.get("sample", ""))
            files.append(
                {
                    "path": f["path"],
                    "uploadMode": self._upload_mode(f["path"], int(f["size"]), sample),
                    "shouldIgnore": False,
                    "oid": None,  # never claim a file is unchanged: every push re-sends its files
                }
            )
        return 200, {"files": files, "commitOid": None}

    def _lfs_batch(self, repo_id: str, payload: dict) -> tuple[int, Any]:
        self._repo(repo_id)
        if payload.get("operation") != "upload":
            raise _HubError(400, f"FakeHubServer: only LFS uploads, got operation={payload.get('operation')!r}")
        if "basic" not in payload.get("transfers", ["basic"]):
            raise _HubError(400, "FakeHubServer: only the 'basic' LFS transfer is supported")
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            with self._lock:
                present = oid in self.lfs_blobs
            if not present:
                entry["actions"] = {
                    "upload": {"href": f"{self.url}/_fake_lfs/upload/{oid}"},
                    "verify": {"href": f"{self.url}/_fake_lfs/verify"},
                }
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, oid: str, body: bytes) -> tuple[int, Any]:
        actual = hashlib.sha256(body).hexdigest()
        if actual != oid:
            raise _HubError(400, f"FakeHubServer: LFS content sha256 {actual} does not match oid {oid}")
        with self._lock:
            self.lfs_blobs[oid] = body
        return 200, {}

    def _lfs_verify(self, payload: dict) -> tuple[int, Any]:
        oid, size = payload.get("oid"), payload.get("size")
        with self._lock:
            blob = self.lfs_blobs.get(oid)
        if blob is None or len(blob) != size:
            raise _HubError(404, f"FakeHubServer: LFS object {oid} (size {size}) was not uploaded")
        return 200, {}

    def _commit(self, repo_id: str, revision: str, body: bytes) -> tuple[int, Any]:
        repo = self._repo(repo_id)
        if revision not in repo.branches:
            raise _HubError(404, f"Invalid rev id: {revision}", error_code="RevisionNotFound")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "FakeHubServer: commit payload must start with a 'header' line")
        summary = lines[0]["value"].get("summary", "")
        added: dict[str, bytes] = {}
        deleted: list[str] = []
        for item in lines[1:]:
            key, value = item.get("key"), item.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _HubError(400, f"FakeHubServer: unsupported encoding {value.get('encoding')!r}")
                added[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                with self._lock:
                    blob = self.lfs_blobs.get(value["oid"])
                if blob is None or len(blob) != value["size"]:
                    raise _HubError(422, f"FakeHubServer: LFS file {value['path']} ({value['oid']}) not uploaded")
                added[value["path"]] = blob
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:
                raise _HubError(400, f"FakeHubServer: unsupported commit operation {key!r}")
        oid = hashlib.sha1(body + repo_id.encode() + str(len(self.commits)).encode()).hexdigest()
        with self._lock:
            files = repo.branches[revision]
            for path in deleted:
                for existing in [p for p in files if p == path or p.startswith(path.rstrip("/") + "/")]:
                    del files[existing]
            files.update(added)
            self.commits.append(FakeCommit(repo_id, revision, oid, summary, sorted(added), deleted))
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
