"""The small HTTP endpoint both programs serve: /metrics, /healthz, /readyz, and any read-only pages a
program adds (the relay's /status).

A page is a function that renders the whole document on each GET; it is served with a content security
policy that allows no scripts and nothing from elsewhere (only the page's own inline style), so a value
that slipped through escaping still could not run or call out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("relay_common.httpserver")


def split_host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(frozen=True, slots=True)
class Page:
    render: Callable[[], bytes]
    content_type: str = "text/html; charset=utf-8"


_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class MetricsServer:
    def __init__(self, httpd: ThreadingHTTPServer) -> None:
        self.httpd = httpd
        self.thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @classmethod
    def start(
        cls,
        listen: str,
        registry: CollectorRegistry,
        ready: Callable[[], bool] = lambda: True,
        pages: Mapping[str, Page] | None = None,
    ) -> MetricsServer | None:
        if not listen:
            return None
        host, port = split_host_port(listen)
        extra = dict(pages or {})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._reply(200, b"ok\n")
                elif path == "/readyz":
                    ok = ready()
                    self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                elif path in extra:
                    page = extra[path]
                    try:
                        body = page.render()
                    except Exception:  # a broken page must not take the metrics endpoint with it
                        log.exception("rendering %s failed", path)
                        self._reply(500, b"this page failed; see the log\n")
                    else:
                        self._reply(200, body, page.content_type, _PAGE_HEADERS)
                else:
                    self._reply(404, b"not found\n")

            def _reply(
                self,
                code: int,
                body: bytes,
                ctype: str = "text/plain; charset=utf-8",
                headers: Mapping[str, str] | None = None,
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = cls(ThreadingHTTPServer((host, port), Handler))
        server.httpd.daemon_threads = True
        server.thread.start()
        log.info("serving %s on %s:%d", ", ".join(["/metrics", *extra]), host, server.port)
        return server

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
