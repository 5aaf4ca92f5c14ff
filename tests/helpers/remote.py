"""fsspec's memory:// store and an HTTP server on 127.0.0.1 holding files for the remote-data tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import urlsplit

import pytest


class Store(BaseHTTPRequestHandler):
    """Serves `files` (name → bytes) with sizes and byte ranges, as object stores and web servers do; a name in
    `failing` answers 503 to every GET, one in `flaky` to its first `flaky[name]` GETs. `gets` counts the GETs."""

    files: ClassVar[dict[str, bytes]] = {}
    failing: ClassVar[set[str]] = set()
    flaky: ClassVar[dict[str, int]] = {}
    gets: ClassVar[dict[str, int]] = {}

    def do_HEAD(self) -> None:
        body = self.files.get(self.name)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.send_header("ETag", f'"{hash(body)}"')
        self.end_headers()

    def do_GET(self) -> None:
        self.gets[self.name] = self.gets.get(self.name, 0) + 1
        body = self.files.get(self.name)
        if body is None or self.name in self.failing or self.gets[self.name] <= self.flaky.get(self.name, 0):
            self.send_error(404 if body is None else 503)
            return
        start, end = 0, len(body) - 1
        ranged = self.headers.get("Range", "").removeprefix("bytes=")
        if ranged:
            first, _, last = ranged.partition("-")
            start, end = int(first), min(int(last or end), end)
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(end + 1 - start))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(body)}")
        self.end_headers()
        self.wfile.write(body[start : end + 1])

    @property
    def name(self) -> str:
        return urlsplit(self.path).path

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Store.files, Store.failing, Store.flaky, Store.gets = {}, set(), {}, {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Store)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)
