"""A local stand-in of the hub's HTTP API: the endpoints huggingface_hub calls for `create_repo`, `upload_folder`
(preupload, then one commit whose files travel inline as base64: every file is answered "regular", so no LFS or Xet
transfer is asked for) and `snapshot_download` / `hf_hub_download` (the revision's file list, then HEAD and GET of
each file). Model repos only, in memory, any token accepted (and recorded). Point huggingface_hub at it with
HF_ENDPOINT=server.url (read when huggingface_hub is imported: set it in a subprocess's environment)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import unquote, urlparse

USER = "tester"  # the namespace of a repo created without one (the token's user on the real hub)


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> path -> content
        self.commits: dict[str, str] = {}  # repo id -> the head commit's id
        self.tokens: set[str] = set()  # Authorization headers seen
        self.validated: list[dict] = []  # README.md metadata that /api/validate-yaml checked
        self.unhandled: list[str] = []  # requests it could not answer (a test asserts there are none)
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                standin._dispatch(self, "HEAD")

            def do_GET(self):
                standin._dispatch(self, "GET")

            def do_POST(self):
                standin._dispatch(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # port 0: a free one
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- HTTP ----

    def _dispatch(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlparse(h.path).path)
        if h.headers.get("Authorization"):
            self.tokens.add(h.headers["Authorization"])
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        routes = [
            ("POST", r"/api/repos/create", self._create),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)", self._preupload),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)", self._commit),
            ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/]+))?", self._info),
            ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(/(?P<folder>.*))?", self._tree),
            ("GET", r"/api/agent-harnesses", self._harnesses),
            ("POST", r"/api/validate-yaml", self._validate_yaml),
            (None, r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self._resolve),
        ]
        for want, pattern, fn in routes:
            m = re.fullmatch(pattern, path)
            if m and want in (None, method):
                status, headers, content = fn(body=body, method=method, **m.groupdict())
                break
        else:
            self.unhandled.append(f"{method} {h.path}")
            status, headers, content = 404, {}, json.dumps({"error": f"stand-in: no route {path}"}).encode()
        if status >= 400 and "X-Error-Message" not in headers:
            headers["X-Error-Message"] = json.loads(content or b"{}").get("error", "error")
        h.send_response(status)
        headers.setdefault("Content-Type", "application/json")
        headers["Content-Length"] = str(len(content))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if method != "HEAD":
            h.wfile.write(content)

    @staticmethod
    def _json(data, status: int = 200, headers: dict | None = None):
        return status, dict(headers or {}), json.dumps(data).encode()

    def _missing(self, repo: str):
        return (
            404,
            {"X-Error-Code": "RepoNotFound"},
            json.dumps({"error": f"Repository {repo} not found"}).encode(),
        )

    # ---- endpoints ----

    def _create(self, body: bytes, **_):
        req = json.loads(body)
        repo = f"{req.get('organization') or USER}/{req['name']}"
        if repo in self.repos:
            return self._json(
                {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}, 409
            )
        self.repos[repo] = {}
        self.commits[repo] = hashlib.sha1(repo.encode()).hexdigest()
        return self._json({"url": f"{self.url}/{repo}", "name": repo})

    def _preupload(self, body: bytes, repo: str, **_):
        if repo not in self.repos:
            return self._missing(repo)
        files = json.loads(body)["files"]
        return self._json(
            {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
        )

    def _commit(self, body: bytes, repo: str, **_):
        if repo not in self.repos:
            return self._missing(repo)
        for line in body.decode().splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                value = item["value"]
                self.repos[repo][value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "deletedFile":
                self.repos[repo].pop(item["value"]["path"], None)
            elif item["key"] != "header":
                return self._json({"error": f"stand-in: no {item['key']} in commits"}, 400)
        digest = hashlib.sha1()
        for path in sorted(self.repos[repo]):
            digest.update(path.encode() + self.repos[repo][path])
        self.commits[repo] = digest.hexdigest()
        oid = self.commits[repo]
        return self._json({"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True})

    def _info(self, repo: str, rev: str | None = None, **_):
        if repo not in self.repos:
            return self._missing(repo)
        siblings = [{"rfilename": p, "size": len(c)} for p, c in sorted(self.repos[repo].items())]
        return self._json(
            {"id": repo, "modelId": repo, "sha": self.commits[repo], "siblings": siblings, "private": False}
        )

    def _tree(self, repo: str, folder: str | None = None, **_):
        """Every file under `folder` (recursive=true; there is no pagination: one page), and their folders."""
        if repo not in self.repos:
            return self._missing(repo)
        prefix = f"{folder.rstrip('/')}/" if folder else ""
        entries, folders = [], set()
        for path, content in sorted(self.repos[repo].items()):
            if not path.startswith(prefix):
                continue
            parts = path.split("/")
            folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
            oid = hashlib.sha1(content).hexdigest()
            entries.append({"type": "file", "oid": oid, "size": len(content), "path": path})
        entries += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)]
        return self._json(entries)

    def _validate_yaml(self, body: bytes, **_):
        """The model card's metadata (YAML between '---' lines) must be a mapping whose tags are a list of strings
        and whose base_model, if any, names a hub repo: a small part of what the hub checks, answered as it does."""
        import yaml

        content = json.loads(body)["content"]
        m = re.match(r"^---\n(.*?)\n---", content, re.DOTALL)
        errors = []
        try:
            meta = yaml.safe_load(m.group(1)) if m else {}
        except yaml.YAMLError as e:
            meta, errors = {}, [{"message": f"invalid YAML: {e}"}]
        if not isinstance(meta, dict):
            errors.append({"message": "metadata must be a mapping"})
        else:
            tags = meta.get("tags", [])
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                errors.append({"message": '"tags" must be a list of strings'})
            base = meta.get("base_model")
            if base is not None and not (isinstance(base, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", base)):
                errors.append({"message": f'"base_model" {base!r} is not a model id'})
            self.validated.append(meta)
        return self._json({"errors": errors, "warnings": []}, 400 if errors else 200)

    def _harnesses(self, **_):  # huggingface_hub's best-effort agent detection: an empty registry
        return self._json({"standardEnvVars": [], "harnesses": {}})

    def _resolve(self, method: str, repo: str, rev: str, file: str, **_):
        if repo not in self.repos:
            return self._missing(repo)
        content = self.repos[repo].get(file)
        if content is None:
            return 404, {"X-Error-Code": "EntryNotFound"}, json.dumps({"error": f"{file} not found"}).encode()
        headers = {
            "X-Repo-Commit": self.commits[repo],
            "ETag": f'"{hashlib.sha1(content).hexdigest()}"',
            "Content-Type": "application/octet-stream",
        }
        return 200, headers, content
