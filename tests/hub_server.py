"""A Hugging Face hub on a loopback port, for the tests: the routes ``huggingface_hub``
calls to fetch a model, answered the way the hub answers them.

- ``GET /api/models/{repo}[/revision/{rev}]``: the repository's commit and files;
- ``GET /api/models/{repo}/tree/{rev}``: the file listing ``snapshot_download`` reads;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: the file, with ``ETag``,
  ``X-Repo-Commit`` and ``Content-Length``, and ``Range`` for resumed downloads;
- errors with the hub's ``X-Error-Code`` headers: ``RepoNotFound`` (404, or 401 for a
  private one without its token), ``GatedRepo`` (401 without the token), ``EntryNotFound``,
  ``RevisionNotFound``.

Every request is recorded, so a test can say the server saw none. ``drop_once`` makes the
first GET of a file send half of it and close the connection, as a dropped network does.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK_BYTES = 1 << 20


@dataclass
class HubFile:
    path: Path
    size: int = 0
    sha256: str = ""

    def __post_init__(self) -> None:
        digest = hashlib.sha256()
        size = 0
        with self.path.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
        self.size = size
        self.sha256 = digest.hexdigest()


@dataclass
class HubRepo:
    files: dict[str, HubFile]
    commit: str  # 40 hex digits, as the hub's commit ids
    token: str | None = None  # the bearer token it needs; None: public
    gated: bool = False  # with a token: gated (GatedRepo) rather than private (RepoNotFound)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class LoopbackHub:
    """The hub's state: its repositories, what it saw, what it is told to break."""

    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)
    drop_once: set[tuple[str, str]] = field(default_factory=set)  # (repo, file)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_repo(
        self, repo: str, folder: Path, *, token: str | None = None, gated: bool = False
    ) -> HubRepo:
        """Serve the files of ``folder`` (not its subfolders) as ``repo`` at one commit."""
        files = {p.name: HubFile(p) for p in sorted(folder.iterdir()) if p.is_file()}
        digest = hashlib.sha1(repo.encode())
        for name, f in files.items():
            digest.update(f"{name}:{f.sha256}".encode())
        entry = HubRepo(files, digest.hexdigest(), token, gated)
        self.repos[repo] = entry
        return entry

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()
            self.dropped.clear()
            self.drop_once.clear()

    def seen(self) -> list[Seen]:
        with self.lock:
            return list(self.requests)


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the tests read ``LoopbackHub.requests`` instead."""

    def do_GET(self) -> None:
        self._handle(body=True)

    def do_HEAD(self) -> None:
        self._handle(body=False)

    # -- routing ---------------------------------------------------------------------------
    def _handle(self, body: bool) -> None:
        hub = self.server.hub
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        with hub.lock:
            hub.requests.append(
                Seen(
                    self.command,
                    path,
                    self.headers.get("Range"),
                    self.headers.get("Authorization"),
                )
            )
        if m := _TREE.match(path):
            self._tree(m.group(1), m.group(2), body)
        elif m := _API.match(path):
            self._info(m.group(1), m.group(2) or "main", parse_qs(parts.query), body)
        elif m := _RESOLVE.match(path):
            self._resolve(m.group(1), m.group(2), m.group(3), body)
        else:
            self._error(404, "EntryNotFound", f"no route {path}", body)

    def _repo(self, repo_id: str, revision: str, body: bool) -> HubRepo | None:
        """The repository if this request may see it at ``revision``; else answers the error."""
        repo = self.server.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found", body)
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            if repo.gated:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted", body)
            else:
                self._error(401, "RepoNotFound", f"Repository {repo_id} not found", body)
            return None
        if revision not in ("main", repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return None
        return repo

    def _info(self, repo_id: str, revision: str, query: dict[str, list[str]], body: bool) -> None:
        repo = self._repo(repo_id, revision, body)
        if repo is None:
            return
        blobs = query.get("blobs") == ["true"] or query.get("blobs") == ["True"]
        siblings = [
            {"rfilename": name, **({"size": f.size, "blobId": f.sha256[:40]} if blobs else {})}
            for name, f in repo.files.items()
        ]
        self._json(
            {
                "_id": repo.commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.commit,
                "private": repo.token is not None and not repo.gated,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": ["whisper"],
                "siblings": siblings,
            },
            body,
        )

    def _tree(self, repo_id: str, revision: str, body: bool) -> None:
        repo = self._repo(repo_id, revision, body)
        if repo is None:
            return
        entries = [
            {
                "type": "file",
                "path": name,
                "size": f.size,
                "oid": f.sha256[:40],
                "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134},
            }
            for name, f in repo.files.items()
        ]
        self._json(entries, body)

    def _resolve(self, repo_id: str, revision: str, filename: str, body: bool) -> None:
        repo = self._repo(repo_id, revision, body)
        if repo is None:
            return
        f = repo.files.get(filename)
        if f is None:
            self._error(404, "EntryNotFound", f"{filename} does not exist on {revision}", body)
            return
        start = 0
        status = 200
        wanted = self.headers.get("Range")
        if wanted and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())):
            start = int(m.group(1))
            if start >= f.size:
                self._error(416, "RangeNotSatisfiable", f"range {wanted} of {f.size}", body)
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(f.size - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{f.sha256}"')
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("X-Linked-Size", str(f.size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{f.size - 1}/{f.size}")
        self.end_headers()
        if not body:
            return
        hub = self.server.hub
        key = (repo_id, filename)
        with hub.lock:
            drop = key in hub.drop_once
            hub.drop_once.discard(key)
        stop_at = start + (f.size - start) // 2 if drop else f.size
        with f.path.open("rb") as fh:
            fh.seek(start)
            sent = start
            while sent < stop_at:
                chunk = fh.read(min(CHUNK_BYTES, stop_at - sent))
                if not chunk:
                    break
                self.wfile.write(chunk)
                sent += len(chunk)
        if drop:
            # Half the promised bytes, then the connection goes: a dropped network.
            with hub.lock:
                hub.dropped.append(key)
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)

    # -- answers ---------------------------------------------------------------------------
    def _json(self, payload: object, body: bool) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, body: bool) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.end_headers()
        if body:
            self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: LoopbackHub


@contextmanager
def serve_hub(hub: LoopbackHub) -> Iterator[LoopbackHub]:
    """Run ``hub`` on a free loopback port for the ``with`` block; ``hub.url`` is its address."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.hub = hub
    thread = threading.Thread(target=server.serve_forever, name="loopback-hub", daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
