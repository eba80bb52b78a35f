"""Made-up batches of a node, as its relay would publish them, for the tests of the cloud side.

``make_batch``: ``series`` series of one metric, told apart by a ``zone`` label, times ``scrapes``
scrape blocks ``step_ms`` apart (or the label sets a test gives). Every value is unique per
(seq, series, scrape), so a sample found in a receiver tells which batch, series and scrape it came
from.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence

from schemas.model import Batch, Labels, ScrapeBlock

CLUSTER = "test"
METRIC = "kepler_node_package_joules_total"


def make_batch(
    node: str,
    seq: int,
    ts_ms: int,
    *,
    cluster: str = CLUSTER,
    metric: str = METRIC,
    series: int = 3,
    scrapes: int = 2,
    step_ms: int = 500,
    zone: str = "pkg",
    blob_bytes: int = 0,
    labelsets: Sequence[Labels] | None = None,
    incarnation: int = 0,
) -> Batch:
    """``series`` series (zones ``{zone}0``, ``{zone}1``, ... of ``metric``, each with ``blob_bytes``
    incompressible bytes in a ``blob`` label if asked; or ``labelsets``) x ``scrapes`` scrape blocks
    ``step_ms`` apart from ``ts_ms``."""
    if labelsets is None:
        labelsets = []
        for i in range(series):
            labels = {"__name__": metric, "cluster": cluster, "node": node, "zone": f"{zone}{i}"}
            if blob_bytes:
                labels["blob"] = os.urandom(blob_bytes).hex()
            labelsets.append(tuple(sorted(labels.items())))
    count = len(labelsets)
    blocks = [
        ScrapeBlock(
            ts_ms + step_ms * k,
            array("I", range(count)),
            array("d", [seq * 1000 + i * 10 + k + 0.25 for i in range(count)]),
        )
        for k in range(scrapes)
    ]
    return Batch(cluster, node, seq, list(labelsets), blocks, incarnation=incarnation)
