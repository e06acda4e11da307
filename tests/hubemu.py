"""A Hugging Face hub on 127.0.0.1 for tests: the part of the hub's HTTP API that
huggingface_hub's downloads use (``HF_ENDPOINT`` points every client at it), serving local
folders as model repos (or dataset repos: ``Hub.add(..., kind="dataset")``, ids
``datasets/owner/name`` here, under ``/datasets/`` and ``/api/datasets/`` as on the hub),
each push (``Hub.add``) a new commit of the repo, its earlier ones still readable by their
hashes.

The hub cannot be reached here (nor in CI). The servers on PyPI that speak its API are
mirrors (olah) that serve what they fetched from the hub or git repos, without gating, so
this one serves folders, as the hub answers (huggingface_hub 2.x reads these answers):
- ``HEAD|GET /{repo}/resolve/{revision}/{path}``: the file, with ``X-Repo-Commit`` and an
  ``ETag``; a missing file is 404 ``X-Error-Code: EntryNotFound``;
- ``GET /api/models/{repo}[/revision/{revision}]``: the repo's commit and files (their
  sizes too with ``?blobs=True``);
- ``GET /api/models/{repo}/tree/{revision}[/{path}]``: a folder's entries;
- an unknown repo is 401 ``RepoNotFound``, an unknown revision 404 ``RevisionNotFound``;
- a gated repo's files answer 401 ``GatedRepo`` to a request without its token (403 with
  a wrong one); its file list is public, as on the hub.

It runs in a thread of the test process (as moto's ThreadedMotoServer does) and records
the bearer tokens it was sent, per file, so a test can see which processes sent one.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http import server as http_server
from urllib.parse import parse_qs, unquote, urlparse


class Hub:
    def __init__(self):
        self.repos: dict[str, str] = {}  # repo id → local folder
        self.tokens: dict[str, str] = {}  # gated repo id → the token that may read it
        self.commits: dict[str, str] = {}  # repo id → its commit (main)
        self.branches: dict[str, dict[str, str]] = {}  # repo id → {other branch: commit}
        self.history: dict[str, dict[str, str]] = {}  # repo id → {commit: folder}
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path, bearer token)
        self._lock = threading.Lock()
        self._srv = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._srv.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()

    def add(self, repo: str, folder: str, token: str | None = None, version: int = 0,
            branch: str = "main", kind: str = "model") -> str:
        """Serve ``folder`` as model (or dataset) repo ``repo`` (gated behind ``token`` if
        given) at its commit ``version`` (another: as if pushed to, ``branch`` moved there,
        the earlier commit still served by its hash); returns that commit's hash."""
        if kind == "dataset":
            repo = "datasets/" + repo
        sha = commit(repo, version)
        self.history.setdefault(repo, {})[sha] = os.path.abspath(folder)
        if branch == "main" or repo not in self.repos:
            self.repos[repo], self.commits[repo] = os.path.abspath(folder), sha
        if branch != "main":
            self.branches.setdefault(repo, {})[branch] = sha
        if token:
            self.tokens[repo] = token
        return sha

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    def record(self, method: str, path: str, token: str | None) -> None:
        with self._lock:
            self.seen.append((method, path, token))


def commit(repo: str, version: int = 0) -> str:
    """A repo's commit: 40 hex digits, fixed per repo id and version."""
    return hashlib.sha1(f"{repo}@{version}".encode()).hexdigest()


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                  for d, _, names in os.walk(folder) for f in names)


def _handler(hub: Hub):
    class Handler(http_server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: a test's output stays its own
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _reply(self, status: int, body: bytes = b"", headers: dict | None = None,
                   send_body: bool = True) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _error(self, status: int, code: str, send_body: bool) -> None:
            self._reply(status, json.dumps({"error": code}).encode(),
                        {"X-Error-Code": code, "X-Error-Message": code,
                         "Content-Type": "application/json"}, send_body)

        def _serve(self, body: bool) -> None:
            url = urlparse(self.path)
            path, query = unquote(url.path), parse_qs(url.query)
            auth = self.headers.get("Authorization") or ""
            token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
            hub.record(self.command, path, token)
            # Each segment unquoted on its own: a revision may hold a slash (%2F).
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            api = parts[:2] in (["api", "models"], ["api", "datasets"])
            if api:
                kind, parts = parts[1], parts[2:]
                parts = (["datasets"] if kind == "datasets" else []) + parts
            n = 3 if parts[:1] == ["datasets"] else 2  # a dataset's id: datasets/owner/name
            repo = "/".join(parts[:n])
            rest = parts[n:]
            if repo not in hub.repos:
                return self._error(401, "RepoNotFound", body)
            if api:
                return self._api(repo, rest, query, body)
            gate = hub.tokens.get(repo)
            if gate and token != gate:
                return self._error(401 if token is None else 403, "GatedRepo", body)
            if len(rest) < 3 or rest[0] != "resolve":
                return self._error(404, "EntryNotFound", body)
            sha, folder = self._at(repo, rest[1])
            if folder is None:
                return self._error(404, "RevisionNotFound", body)
            file = os.path.join(folder, *rest[2:])
            if not os.path.isfile(file):
                return self._error(404, "EntryNotFound", body)
            data = open(file, "rb").read()
            self._reply(200, data, {"X-Repo-Commit": sha,
                                    "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                                    "Content-Type": "application/octet-stream"}, body)

        def _at(self, repo: str, revision: str) -> tuple[str, str | None]:
            """(commit, folder) of ``revision`` (a branch or a commit hash); folder None: none."""
            sha = (hub.commits[repo] if revision == "main"
                   else hub.branches.get(repo, {}).get(revision, revision))
            return sha, hub.history[repo].get(sha)

        def _api(self, repo: str, rest: list[str], query: dict, body: bool) -> None:
            sha, folder = self._at(repo, rest[1] if rest[:1] in (["revision"], ["tree"])
                                   and len(rest) >= 2 else "main")
            if folder is None:
                return self._error(404, "RevisionNotFound", body)
            if rest[:1] in ([], ["revision"]):
                blobs = query.get("blobs", [""])[0].lower() == "true"
                info = {"id": repo.removeprefix("datasets/"), "modelId": repo, "sha": sha,
                        "private": False, "gated": "manual" if repo in hub.tokens else False,
                        "siblings": [{"rfilename": f, **({"size": os.path.getsize(
                            os.path.join(folder, f))} if blobs else {})} for f in _files(folder)]}
                return self._reply(200, json.dumps(info).encode(),
                                   {"Content-Type": "application/json"}, body)
            if rest[:1] == ["tree"] and len(rest) >= 2:
                sub = os.path.join(folder, *rest[2:])
                if not os.path.isdir(sub):
                    return self._error(404, "EntryNotFound", body)
                prefix = "/".join(rest[2:])
                if query.get("recursive") == ["true"]:
                    names = [os.path.relpath(os.path.join(d, n), sub).replace(os.sep, "/")
                             for d, dirs, files in os.walk(sub) for n in dirs + files]
                else:
                    names = os.listdir(sub)
                entries = [{"type": "directory" if os.path.isdir(os.path.join(sub, n)) else "file",
                            "path": f"{prefix}/{n}" if prefix else n,
                            "size": os.path.getsize(os.path.join(sub, n)), "oid": sha}
                           for n in sorted(names)]
                return self._reply(200, json.dumps(entries).encode(),
                                   {"Content-Type": "application/json"}, body)
            return self._error(404, "EntryNotFound", body)

    return Handler
