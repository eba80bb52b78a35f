"""Wrong credentials for a receiver behind TLS and basic auth, end to end: the edge keeps every batch
(refused, retried, counted as a configuration error, nothing acked, nothing lost), and once the password
file holds the right password (rotated, no restart) everything arrives and is acked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_cloud_refusals import (
    expected,
    ingest_metric,
    make_batch,
    relay_metric,
    spool_batch,
    spool_seqs,
)

# Fixtures, asked for by their pytest names.
from test_cloud_refusals import make_ingester as make_ingester
from test_cloud_refusals import make_uplink as make_uplink
from test_write_auth import guarded as guarded
from test_write_auth import pki as pki
from test_write_auth import target

from cloud_ingest.app import Ingester
from edge_relay.store.spool import Spool
from edge_relay.uplink.mqtt import Uplink
from testkit.pki import Pki
from testkit.services import Mosquitto, Prometheus, now_ms, wait_until


@pytest.mark.timeout(120)
def test_wrong_credentials_keep_every_batch_at_the_edge_and_a_rotated_password_delivers_them(
    tmp_path: Path,
    guarded: Prometheus,
    pki: Pki,
    mosquitto: Mosquitto,
    spool: Spool,
    make_uplink: Callable[..., Uplink],
    make_ingester: Callable[..., Ingester],
) -> None:
    password = tmp_path / "password"
    password.write_text("expired-password")
    rw = target(guarded, pki, password)
    ingester = make_ingester(
        rw["url"], remote_write__basic_auth=rw["basic_auth"], remote_write__tls_config=rw["tls_config"]
    )
    base = now_ms() - 60_000
    batches = [spool_batch(spool, lambda s, k=k: make_batch(s, base + 5000 * k)) for k in range(3)]
    uplink = make_uplink(mosquitto, spool)

    wait_until(
        lambda: ingest_metric(ingester, "cloud_ingest_remote_write_config_errors_total", status="401") >= 4,
        20,
        message="401 answers counted",
    )
    assert spool_seqs(spool) == [b.seq for b in batches]
    assert relay_metric(uplink, "edge_relay_batches_acked_total", result="rejected") == 0
    assert spool.losses.totals() == {}
    assert ingester.dead_letters.list() == []

    password.write_text("right-password\n")  # the operator rotates the secret; nothing restarts
    wait_until(lambda: not spool_seqs(spool), 30, message="every batch acked ok")
    assert relay_metric(uplink, "edge_relay_batches_acked_total", result="ok") == 3
    assert spool.losses.totals() == {}
    assert guarded.raw_samples('{__name__="kepler_test_joules_total"}') == expected(*batches)
