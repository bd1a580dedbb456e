"""A Hugging Face Hub on loopback for tests: the endpoints `huggingface_hub.snapshot_download` uses.

    hub = FakeHub({"org/tiny": Repo(path)}, gated={"org/gated"})   # started on 127.0.0.1, a free port
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": ...}                  # huggingface_hub reads these at import

    GET  /api/models/{repo}/revision/{rev}        repo info: sha, siblings
    GET  /api/models/{repo}/tree/{rev}            the file listing (one page)
    HEAD /{repo}/resolve/{rev}/{file}             X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}             the bytes (Range honoured, for resumed downloads)

Unknown repositories answer 404 RepoNotFound, unknown revisions 404 RevisionNotFound, gated
repositories 401 GatedRepo on file downloads without an `Authorization: Bearer` header, as
the Hub does. Every request is logged in `requests` so tests can see what was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    path: Path
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())


class FakeHub:
    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloaded(self) -> list[str]:
        """Files whose bytes were served."""
        return [p.rsplit("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                if m == "GET" and "/resolve/" in p]

    # -----------------------------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.requests.append(("GET" if body else "HEAD", path))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?", path):
            repo, kind, rev = m.groups()
            r = self._repo(h, repo, rev)
            if r is None:
                return
            if kind == "revision":
                data = {"id": repo, "modelId": repo, "sha": r.sha, "private": False, "gated": r.gated,
                        "siblings": [{"rfilename": f} for f in r.files()]}
            else:
                data = [{"type": "file", "path": f, "size": (r.path / f).stat().st_size, "oid": _oid(r.path / f)}
                        for f in r.files()]
            return self._send(h, 200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, rev, name = m.groups()
            r = self._repo(h, repo, rev)
            if r is None:
                return
            if r.gated and not h.headers.get("Authorization", "").startswith("Bearer "):
                return self._send(h, 401, b"gated", {"X-Error-Code": "GatedRepo"}, body)
            f = r.path / name
            if not f.is_file():
                return self._send(h, 404, b"no entry", {"X-Error-Code": "EntryNotFound"}, body)
            data = f.read_bytes()
            headers = {"X-Repo-Commit": r.sha, "ETag": f'"{_oid(f)}"', "Accept-Ranges": "bytes"}
            start = int(rng.group(1)) if (rng := re.match(r"bytes=(\d+)-", h.headers.get("Range", ""))) else 0
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(h, 206 if start else 200, data[start:], headers, body)
        self._send(h, 404, b"not found", {}, body)

    def _repo(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> Repo | None:
        r = self.repos.get(repo)
        if r is None:
            self._send(h, 404, b"repo not found", {"X-Error-Code": "RepoNotFound"}, True)
        elif rev not in ("main", r.sha):
            self._send(h, 404, b"revision not found", {"X-Error-Code": "RevisionNotFound"}, True)
            r = None
        return r

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def _oid(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
