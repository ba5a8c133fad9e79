"""A stand-in for the Hugging Face hub's file API on loopback, for the real ``huggingface_hub`` client.

It serves model folders a test made, as repositories at one commit (``HF_ENDPOINT=hub.url``):

- ``HEAD``/``GET /{repo}/resolve/{revision}/{file}``: the file, with the headers huggingface_hub reads
  (``X-Repo-Commit``, ``ETag``, ``Content-Length``), ranges (``Range: bytes=N-``, for resumed downloads), 404 with
  ``X-Error-Code: EntryNotFound`` for a missing file, 401 for a private repository without its token;
- ``GET /api/models/{repo}/revision/{revision}``: the repository's files (``snapshot_download`` lists them).

Every request is recorded (`StandinHub.requests`); ``rate`` (bytes per second) slows file bodies down, so that a
test can stop a download midway.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

COMMIT = "ab" * 20


@dataclass
class Request:
    """One request the stand-in answered."""

    method: str
    repo: str
    filename: str
    start: int = 0
    status: int = 200


@dataclass
class StandinHub:
    """The stand-in: ``repos`` maps a repository id to its folder; ``tokens`` the private ones to their token."""

    repos: dict[str, Path]
    tokens: dict[str, str] = field(default_factory=dict)
    rate: float | None = None
    requests: list[Request] = field(default_factory=list)
    server: Any = None

    @property
    def url(self) -> str:
        """The endpoint (``HF_ENDPOINT``)."""
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def downloaded(self, repo: str) -> list[str]:
        """Files of ``repo`` whose bodies were sent (GET answered 200 or 206), in order, once each."""
        seen: list[str] = []
        for r in self.requests:
            if r.repo == repo and r.method == "GET" and r.status in (200, 206) and r.filename not in seen:
                seen.append(r.filename)
        return seen

    def start(self) -> StandinHub:
        """Listen on 127.0.0.1 (a free port), in a daemon thread."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="standin-hub", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    # ------------------------------------------------------------------ answers
    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(handler.path.split("?", 1)[0])
        if path.startswith("/api/models/"):
            self._listing(handler, path[len("/api/models/"):])
            return
        repo, sep, rest = path.lstrip("/").partition("/resolve/")
        revision, _, filename = rest.partition("/")
        if not sep or repo not in self.repos:
            self._error(handler, 404, "RepoNotFound", Request(handler.command, repo, filename, status=404))
            return
        if not self._allowed(handler, repo):
            self._error(handler, 401, "RepoNotFound", Request(handler.command, repo, filename, status=401))
            return
        file = self.repos[repo] / filename
        if revision not in ("main", COMMIT) or not file.is_file():
            code = "RevisionNotFound" if revision not in ("main", COMMIT) else "EntryNotFound"
            self._error(handler, 404, code, Request(handler.command, repo, filename, status=404))
            return
        data = file.read_bytes()
        start = _range_start(handler.headers.get("Range"))
        status = 206 if start else 200
        self.requests.append(Request(handler.command, repo, filename, start, status))
        handler.send_response(status)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if body:
            self._send(handler, data[start:])

    def _send(self, handler: BaseHTTPRequestHandler, data: bytes) -> None:
        chunk = 16 << 10
        try:
            for i in range(0, len(data), chunk):
                handler.wfile.write(data[i:i + chunk])
                if self.rate:
                    time.sleep(chunk / self.rate)
        except (BrokenPipeError, ConnectionResetError):  # the client went away mid-download
            pass

    def _allowed(self, handler: BaseHTTPRequestHandler, repo: str) -> bool:
        token = self.tokens.get(repo)
        return token is None or handler.headers.get("Authorization") == f"Bearer {token}"

    def _listing(self, handler: BaseHTTPRequestHandler, rest: str) -> None:
        repo = rest.split("/revision/")[0]
        if repo not in self.repos or not self._allowed(handler, repo):
            self._error(handler, 404, "RepoNotFound", Request("GET", repo, "", status=404))
            return
        files = sorted(p.relative_to(self.repos[repo]).as_posix() for p in self.repos[repo].rglob("*") if p.is_file())
        body = json.dumps({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}).encode()
        self.requests.append(Request("GET", repo, "(listing)"))
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _error(self, handler: BaseHTTPRequestHandler, status: int, code: str, request: Request) -> None:
        self.requests.append(request)
        body = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    first = header[len("bytes="):].split("-", 1)[0]
    return int(first) if first.isdigit() else 0
