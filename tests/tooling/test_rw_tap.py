"""The benches' remote-write tap counts what the receiver accepted, at once or deferred past its reply."""

from __future__ import annotations

from array import array

import pytest

from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
from schemas.model import Batch, ScrapeBlock
from testkit.rw_mock import MockReceiver, Reply
from testkit.rw_mock import receiver_fixture as receiver_fixture
from testkit.rw_tap import RemoteWriteTap

T0 = 1_700_000_000_000


def batch(series: int, ts: int, job: str = "kepler") -> Batch:
    labelsets = [(("__name__", "m"), ("i", str(i)), ("job", job)) for i in range(series)]
    block = ScrapeBlock(ts, array("I", range(series)), array("d", [1.0] * series))
    return Batch("c", "n", 1, labelsets, [block])


@pytest.mark.parametrize("deferred", [False, True])
def test_accepted_samples_are_counted_once_and_duplicates_apart(
    receiver: MockReceiver, deferred: bool
) -> None:
    tap = RemoteWriteTap(receiver.url, deferred=deferred)
    client = RemoteWriteClient(tap.url, max_retry_s=0)
    try:
        assert client.write(batch(50, T0)).status == "written"
        assert client.write(batch(50, T0 + 5000)).status == "written"
        assert client.write(batch(50, T0)).status == "written"  # the first one again
        receiver.default = Reply(500)
        assert client.write(batch(50, T0 + 10_000)).status == "retry_later"  # refused: not counted
        # Readers wait for what a deferred tap still has queued.
        assert tap.distinct_samples() == 100
        assert tap.duplicates == 50
        scrapes, _, _ = tap.scrapes()
        assert scrapes == {("kepler", T0): 50, ("kepler", T0 + 5000): 50}
        assert tap.requests_ok == 3
    finally:
        client.close()
        tap.close()
