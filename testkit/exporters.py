"""Scripted exporters: an HTTP endpoint whose body is a function of the request number, or a body per
path.

For tests that need an exposition no simulator model serves (bad timestamps, duplicates, slow or
huge bodies): ``ScriptedExporter(lambda n: f"x {n}\\n")`` serves request n (from 1) as that text;
``ScriptedExporter(bodies={"good": ..., "bad": ...})`` serves ``/good`` and ``/bad`` (``url("good")``),
and the bodies may be changed while it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONTENT_TYPE = "text/plain; version=0.0.4"


class ScriptedExporter:
    def __init__(
        self,
        body_for: Callable[[int], str | bytes] | None = None,
        content_type: str = CONTENT_TYPE,
        *,
        bodies: dict[str, str] | None = None,
    ) -> None:
        if (body_for is None) == (bodies is None):
            raise ValueError("give either body_for or bodies")
        self.requests = 0
        self.bodies = dict(bodies or {})
        lock = threading.Lock()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    exporter.requests += 1
                    n = exporter.requests
                body = exporter.bodies[self.path.strip("/")] if body_for is None else body_for(n)
                data = body.encode() if isinstance(body, str) else body
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url_of(self, name: str) -> str:
        """The URL that serves ``bodies[name]``."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ScriptedExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
