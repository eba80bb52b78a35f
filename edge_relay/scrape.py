"""Stage 1: fetch one exposition from one target.

A scrape either yields the whole body or fails: a timeout, a non-2xx answer, a body over the size
limit or a broken connection is a failed scrape (``up`` = 0), never a partial one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import requests

ACCEPT = {
    # Text 0.0.4 is preferred: it is what Kepler/dcgm/node-exporter serve by default and parses fastest.
    "auto": "text/plain;version=0.0.4;q=1,application/openmetrics-text;version=1.0.0;q=0.5,*/*;q=0.1",
    "text": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
    "openmetrics": "application/openmetrics-text;version=1.0.0;q=1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
}
USER_AGENT = "kepler-edge-relay/0.1"
_CHUNK = 256 * 1024


@dataclass(frozen=True, slots=True)
class Fetched:
    timestamp_ms: int  # when the scrape started, as Prometheus stamps samples
    ok: bool
    body: str
    content_type: str
    duration_s: float
    error: str = ""
    body_bytes: int = 0


class Scraper:
    """Fetches one target; keeps a keep-alive session."""

    def __init__(self, url: str, *, fmt: str, timeout_s: float, body_limit_bytes: int) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.body_limit_bytes = body_limit_bytes
        self.session = requests.Session()
        # Exporters are local: no HTTP(S)_PROXY / .netrc from the environment (Prometheus ignores them
        # for scrapes too), which also spares requests its per-request environment and netrc lookups.
        self.session.trust_env = False
        self.session.headers.update(
            {
                "Accept": ACCEPT[fmt],
                "Accept-Encoding": "gzip",
                "User-Agent": USER_AGENT,
                "X-Prometheus-Scrape-Timeout-Seconds": f"{timeout_s:g}",
            }
        )

    def fetch(self) -> Fetched:
        started = time.time()
        timestamp_ms = int(started * 1000)
        deadline = time.monotonic() + self.timeout_s

        def failed(error: str) -> Fetched:
            return Fetched(timestamp_ms, False, "", "", time.time() - started, error)

        try:
            with self.session.get(self.url, timeout=self.timeout_s, stream=True) as resp:
                if not 200 <= resp.status_code < 300:
                    return failed(f"HTTP {resp.status_code}")
                chunks: list[bytes] = []
                size = 0
                # iter_content undoes gzip, so the limit applies to the uncompressed body (bomb guard).
                for chunk in resp.iter_content(_CHUNK):
                    size += len(chunk)
                    if size > self.body_limit_bytes:
                        return failed(f"body larger than body_limit_bytes={self.body_limit_bytes}")
                    if time.monotonic() > deadline:
                        return failed(f"timeout after {self.timeout_s:g}s while reading the body")
                    chunks.append(chunk)
                content_type = resp.headers.get("Content-Type", "")
        except requests.RequestException as e:
            return failed(f"{type(e).__name__}: {_short(e)}")
        try:
            body = b"".join(chunks).decode("utf-8")
        except UnicodeDecodeError as e:
            return failed(f"body is not UTF-8: {e}")
        return Fetched(timestamp_ms, True, body, content_type, time.time() - started, "", size)

    def close(self) -> None:
        self.session.close()


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) <= 300 else text[:300] + "..."
