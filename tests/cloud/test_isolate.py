"""Tests of cloud_ingest/isolate.py: finding the samples a receiver refuses, and splitting off the future.

The receiver here is a model of Prometheus' remote-write handler (a request with any bad sample is
refused whole and rolled back, anything else is written), the one thing a real Prometheus cannot be
made to do on demand: refuse an arbitrary chosen set of samples. The end-to-end proof on a real one is
``tests/cloud/test_faults_cloud_bad_sample.py``.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_ingest.isolate import NOT_ISOLATED, isolate, joined, split_future
from schemas import codec
from schemas.model import STALE_NAN, Batch, ScrapeBlock, float_bits

Sample = tuple[int, int, int]  # (series index, timestamp, value bits)


@dataclass
class Outcome:
    status: str
    reason: str = ""


class Receiver:
    """Refuses a request that holds a bad sample, writes every other one."""

    def __init__(self, bad: set[tuple[int, int]], *, fail_after: int | None = None) -> None:
        self.bad = bad
        self.stored: list[Sample] = []
        self.requests = 0
        self.fail_after = fail_after

    def write(self, batch: Batch) -> Outcome:
        self.requests += 1
        if self.fail_after is not None and self.requests > self.fail_after:
            return Outcome("retry_later", "connection refused")
        got = samples(batch)
        if any((s, ts) in self.bad for s, ts, _ in got):
            return Outcome("rejected", "HTTP 400: out of bounds")
        self.stored.extend(got)
        return Outcome("written")


def samples(batch: Batch) -> list[Sample]:
    out = []
    for block in batch.scrapes:
        bits = array("Q")
        bits.frombytes(block.values.tobytes())
        for i, s in enumerate(block.series):
            out.append((batch.labelsets[s], block.sample_timestamp(i), bits[i]))
    return sorted((index_of(batch, ls), ts, b) for ls, ts, b in out)


def index_of(batch: Batch, labels: object) -> int:
    return int(dict(labels)["i"])  # type: ignore[call-overload]


def make_batch(series: int, scrapes: int, *, seq: int = 9, incarnation: int = 5) -> Batch:
    labelsets = [(("__name__", "m"), ("i", str(i))) for i in range(series)]
    blocks = []
    for k in range(scrapes):
        values = array("d", [STALE_NAN if (i + k) % 7 == 0 else i * 10.0 + k for i in range(series)])
        blocks.append(ScrapeBlock(1_000_000 + 5000 * k, array("I", range(series)), values))
    return Batch("c", "n", seq, labelsets, blocks, incarnation)


batches = st.tuples(st.integers(1, 40), st.integers(1, 6)).map(lambda t: make_batch(*t))


@settings(max_examples=150, deadline=None)
@given(batches, st.data())
def test_every_sample_ends_written_or_refused_exactly_once(batch: Batch, data: st.DataObject) -> None:
    everything = samples(batch)
    # At least one: the caller only isolates a batch the receiver refused.
    bad = data.draw(st.sets(st.sampled_from([(s, ts) for s, ts, _ in everything]), min_size=1, max_size=5))
    receiver = Receiver(bad)
    result = isolate(batch, receiver.write, "HTTP 400: out of bounds", max_writes=10_000)
    assert result.status == "done"
    refused = samples(result.refused) if result.refused is not None else []
    assert {(s, ts) for s, ts, _ in refused} == bad
    assert sorted(receiver.stored + refused) == everything  # bits included: the stale marker survives
    assert result.written == len(receiver.stored) == len(everything) - len(bad)
    # Bisection: a few writes per bad sample, not one per sample.
    assert result.writes <= 2 + 2 * len(bad) * math.ceil(math.log2(len(everything) + 1))
    assert result.refused is not None
    assert result.refused.seq == batch.seq and result.refused.incarnation == batch.incarnation
    assert result.reasons == ["HTTP 400: out of bounds"]
    # A dead letter must be a valid batch: it encodes and decodes to the same samples.
    again = codec.decode_batch(codec.encode_batch(result.refused))
    assert samples(again) == refused


def test_the_writes_are_bounded_and_the_rest_is_refused_whole() -> None:
    batch = make_batch(64, 4)
    everything = samples(batch)
    receiver = Receiver({(s, ts) for s, ts, _ in everything})  # a 6 h old backlog: all out of bounds
    result = isolate(batch, receiver.write, "HTTP 400: out of bounds", max_writes=16)
    assert result.writes == receiver.requests == 16
    assert result.written == 0 and receiver.stored == []
    assert result.refused is not None and samples(result.refused) == everything
    assert result.reasons == ["HTTP 400: out of bounds", NOT_ISOLATED.format(16)]


def test_a_receiver_that_stops_answering_ends_in_retry_later() -> None:
    batch = make_batch(16, 2)
    receiver = Receiver({(12, 1_005_000)}, fail_after=2)
    result = isolate(batch, receiver.write, "HTTP 400: out of bounds")
    assert result.status == "retry_later" and result.retry_reason == "connection refused"
    assert result.written == len(receiver.stored) > 0  # what was written stays written


def test_a_single_refused_sample_needs_no_further_write() -> None:
    batch = make_batch(1, 1)
    receiver = Receiver({(0, 1_000_000)})
    result = isolate(batch, receiver.write, "HTTP 400: duplicate sample for timestamp")
    assert receiver.requests == 0 and result.written == 0
    assert result.refused is not None and samples(result.refused) == samples(batch)


def test_split_future_keeps_bits_and_identity() -> None:
    batch = make_batch(3, 4)
    limit = 1_000_000 + 5000 * 2  # the last scrape is "in the future"
    good, future = split_future(batch, limit)
    assert good is not None and future is not None
    assert {ts for _, ts, _ in samples(future)} == {1_015_000}
    assert sorted(samples(good) + samples(future)) == samples(batch)
    assert future.labelsets == batch.labelsets[:3] and future.seq == batch.seq
    assert split_future(batch, 2_000_000)[1] is None
    assert split_future(batch, 0)[0] is None


def test_joined_parts_keep_their_own_labels() -> None:
    batch = make_batch(8, 2)
    _, a = split_future(batch, 1_000_000)
    refused = isolate(batch, Receiver({(2, 1_000_000)}).write, "x").refused
    both = joined(refused, a)
    assert both is not None and refused is not None and a is not None
    assert sorted(samples(both)) == sorted(samples(refused) + samples(a))
    assert joined(None, a) is a and joined(refused, None) is refused
    stale = [b for _, _, b in samples(both) if b == float_bits(STALE_NAN)]
    assert stale  # series 6 at scrape 1 is the stale marker
