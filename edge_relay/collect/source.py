"""What a target's cycle reads its samples from, and what one read gives.

A source turns one cycle into a :class:`Reading`: the samples as ``parse`` gives them (labels, value,
own timestamp or None) or, for a failed read, None with the error and the scrape result the
self-metrics count. ``HttpSource`` is an exporter's page (``scrape`` then ``parse``); ``nvml.NvmlSource``
reads the node's NVIDIA GPUs itself. Both finish by the deadline the target loop gives them, so shaping,
the budget and the recorder see one kind of scrape whatever the source.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_relay.collect.parse import (
    ParseDeadlineExceeded,
    ParseError,
    Sample,
    SampleLimitExceeded,
    SeriesCache,
    parse,
)
from edge_relay.collect.scrape import Scraper


@dataclass(frozen=True, slots=True)
class Reading:
    timestamp_ms: int  # when the read started, as Prometheus stamps samples
    samples: list[Sample] | None  # None: a failed read (``up`` 0)
    error: str = ""
    result: str = "ok"  # ok, http_error, parse_error, sample_limit, timeout, nvml_error


class HttpSource:
    """An exporter's page: one GET, parsed within the deadline (the parser's series cache lives here)."""

    def __init__(self, url: str, *, fmt: str, timeout_s: float, body_limit_bytes: int) -> None:
        self.http = Scraper(url, fmt=fmt, timeout_s=timeout_s, body_limit_bytes=body_limit_bytes)
        self.cache = SeriesCache()

    def read(self, deadline: float, sample_limit: int = 0) -> Reading:
        fetched = self.http.fetch()
        if not fetched.ok:
            return Reading(fetched.timestamp_ms, None, fetched.error, "http_error")
        try:
            samples = parse(fetched.body, fetched.content_type, self.cache, sample_limit, deadline=deadline)
        except SampleLimitExceeded as e:
            return Reading(fetched.timestamp_ms, None, str(e), "sample_limit")
        except ParseDeadlineExceeded as e:
            return Reading(fetched.timestamp_ms, None, str(e), "timeout")
        except ParseError as e:
            return Reading(fetched.timestamp_ms, None, f"cannot parse exposition: {e}", "parse_error")
        return Reading(fetched.timestamp_ms, samples)

    def close(self) -> None:
        self.http.close()
