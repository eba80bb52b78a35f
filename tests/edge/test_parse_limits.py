"""Memory the parser may spend on one body (edge_relay/collect/parse.py; issue 12 item 13).

8 MiB of ``a 1`` lines grew the relay's RSS by 353 MiB: the body was split into one string per line,
every sample was parsed, and only then was the count compared with ``sample_limit``. Now the body is
split one block at a time and the limit is checked after each block, so a body far over the limit
costs the samples up to the limit and one block, whatever its size. Measured with tracemalloc (what
the parse allocates; the body itself is the caller's), never with timing.
"""

from __future__ import annotations

import contextlib
import time
import tracemalloc
from collections.abc import Callable

import pytest

from edge_relay.collect.parse import ParseDeadlineExceeded, SampleLimitExceeded, SeriesCache, parse

LIMIT = 200_000  # the shipped scrape.sample_limit
MiB = 1 << 20


def peak_of(call: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        with contextlib.suppress(SampleLimitExceeded):
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
def test_a_body_ten_times_over_the_limit_stops_at_the_limit(as_bytes: bool) -> None:
    text = "a 1\n" * (2 * MiB)  # 8 MiB, 2,097,152 samples of one series
    body: str | bytes = text.encode() if as_bytes else text
    cache = SeriesCache()
    parse("a 1\n", cache=cache)  # a known series: the fast path, as in a real relay after one scrape
    peak = peak_of(lambda: parse(body, cache=cache, sample_limit=LIMIT))
    # What the samples up to the limit need (a 3-tuple and a float each, ~96 B with the list's slot),
    # those of the block that crossed it (at most 65,536 here) and that block's line strings: 28 MiB
    # measured; before: 313 MiB.
    assert peak < LIMIT * 128 + 8 * MiB, f"peak {peak / MiB:.1f} MiB"
    with pytest.raises(SampleLimitExceeded) as info:
        parse(body, cache=cache, sample_limit=LIMIT)
    assert f"sample_limit {LIMIT} exceeded: body has more than" in str(info.value)


@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
def test_a_body_of_distinct_series_over_the_limit_stops_at_the_limit(as_bytes: bool) -> None:
    text = "".join(f"s{i} 1\n" for i in range(1_000_000))  # 8.9 MB, 1,000,000 series
    body: str | bytes = text.encode() if as_bytes else text
    peak = peak_of(lambda: parse(body, cache=SeriesCache(), sample_limit=LIMIT))
    with pytest.raises(SampleLimitExceeded, match="body has more than"):  # stopped before the end
        parse(body, cache=SeriesCache(), sample_limit=LIMIT)
    # New series cost their cache entries too (the raw text, the label tuple, the pair, three dict
    # slots): 88 MiB measured for the ~226,000 series parsed (~390 B each); before: 346 MiB.
    assert peak < LIMIT * 640 + 4 * MiB, f"peak {peak / MiB:.1f} MiB"


def test_under_the_limit_every_sample_is_kept() -> None:
    body = "a 1\n" * 150_000 + "# HELP b help\n" + 'b{x="y"} 2 1700000000000\n' * 10
    for raw in (body, body.encode()):
        samples = parse(raw, sample_limit=150_010)
        assert len(samples) == 150_010
        assert samples[-1][1:] == (2.0, 1_700_000_000_000)
    with pytest.raises(SampleLimitExceeded, match="body has 150010 samples"):
        parse(body, sample_limit=150_009)  # over in the last block: the exact count is known


def test_a_passed_deadline_stops_the_parse_at_the_next_block() -> None:
    # A huge body must not hold up the cycle (every other target waits for it) beyond the scrape
    # deadline: the parse gives up at the first block boundary past it, with the samples so far named.
    body = b"".join(b"a_%d 1\n" % i for i in range(400_000))  # several 256 KiB blocks
    with pytest.raises(ParseDeadlineExceeded) as err:
        parse(body, "text/plain", SeriesCache(), deadline=time.monotonic() - 1)
    assert "scrape deadline passed while parsing" in str(err.value)
    assert len(parse(body, "text/plain", SeriesCache(), deadline=time.monotonic() + 3600)) == 400_000
