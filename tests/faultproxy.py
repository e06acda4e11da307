"""An HTTP proxy on 127.0.0.1 in front of an S3-compatible server that fails and slows down
some of the requests it forwards, as an overloaded object store does (503 SlowDown)."""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
# What a store answers a request it will never accept, which the SDK does not retry.
ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                 b"<Message>Access Denied</Message></Error>")


class FaultProxy:
    """Forwards to ``upstream``; request n (counted from 1) gets a 503 when n % fail_every
    == 0, and waits ``delay`` seconds first when n % slow_every == 0. ``fail_if(method,
    path, body)`` (path with its query), when given, picks further requests to fail: a
    test aims a fault at one operation on one key, or at one content; it answers True (503
    SlowDown) or 403 (Access Denied). ``failed`` counts the injected errors by method and
    by path, so a test can tell what had to be retried."""

    def __init__(self, upstream: str, fail_every: int = 0, slow_every: int = 0, delay: float = 0.3,
                 fail_if=None):
        self.upstream = urlparse(upstream)
        self.fail_every, self.slow_every, self.delay = fail_every, slow_every, delay
        self.fail_if = fail_if
        self.requests = 0
        self.failed: Counter = Counter()
        self.failed_paths: list[str] = []
        self.slowed = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _any(self):
                body = self._body()
                with proxy._lock:
                    proxy.requests += 1
                    n = proxy.requests
                    fail = (bool(proxy.fail_every) and n % proxy.fail_every == 0) or (
                        proxy.fail_if is not None and proxy.fail_if(self.command, self.path, body))
                    slow = bool(proxy.slow_every) and n % proxy.slow_every == 0
                    if fail:
                        proxy.failed[self.command] += 1
                        proxy.failed_paths.append(self.path)
                    if slow:
                        proxy.slowed += 1
                if slow:
                    time.sleep(proxy.delay)
                if fail:
                    status, error = (403, ACCESS_DENIED) if fail == 403 else (503, SLOW_DOWN)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(error)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                # The body goes on whole, with its length (100-continue was answered here).
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("connection", "transfer-encoding", "expect", "content-length")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                # HEAD: the upstream's length of the object, no body.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def failing_puts(match, times: int, status=True):
    """A ``fail_if`` rule: the first ``times`` PUTs (whole objects or parts of one) of
    each object whose path (``/bucket/key``) ``match`` accepts fail, with ``status``
    (True: 503 SlowDown, which the SDK retries; 403: Access Denied, which it does not)."""
    counts: Counter = Counter()

    def rule(method: str, path: str, body: bytes = b""):
        key = path.split("?", 1)[0]
        if method != "PUT" or not match(key):
            return False
        counts[key] += 1
        return status if counts[key] <= times else False

    rule.counts = counts  # PUTs seen per key, failed or not
    return rule
