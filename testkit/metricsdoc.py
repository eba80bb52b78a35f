"""Markdown reference of every self-metric, generated from the metrics' declarations (``docs/operations.md``).

Each program's metrics class is built on a fresh registry and every family it registers is listed as a
scraper sees it: the exposed name (counters with ``_total``), the type, the label names (a histogram's
``le`` aside) and the help text. The per-node families of the ingester's fleet view come from a collector
that is empty until a node reports; they are listed all the same, because it declares them up front.

``python -m testkit.metricsdoc`` prints the reference, ``--update docs/operations.md`` rewrites
that file's sections between ``<!-- metrics:NAME -->`` markers; a test keeps the file in step with the
declarations.

A documentation tool for the tests and for developers, which neither program imports (it reads both,
so it lives with the tooling, above them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

# Where each program declares its metrics: the one place to change when a metrics module moves.
from cloud_ingest.selfmetrics import IngestMetrics
from edge_relay.selfmetrics import RelayMetrics
from relay_common import docsections

TAG = "metrics"
DOCUMENT = "docs/operations.md"

PROGRAMS: dict[str, Callable[[CollectorRegistry], object]] = {
    "edge-relay": lambda registry: RelayMetrics(registry=registry),
    "cloud-ingest": lambda registry: IngestMetrics(registry=registry),
}


@dataclass(frozen=True)
class Declared:
    """One metric family as a scraper sees it."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


def _label_names(metric: object) -> tuple[str, ...] | None:
    # prometheus_client keeps a declared metric's label names only here, on the metric objects (a
    # Counter, Gauge, Histogram) and on the families a custom collector builds; a child-less metric
    # exposes no sample that would carry them.
    names = getattr(metric, "_labelnames", None)
    return None if names is None else tuple(names)


def declared(program: str) -> list[Declared]:
    """Every metric family ``program`` registers, in the order it declares them."""
    registry = CollectorRegistry()
    metrics = PROGRAMS[program](registry)
    wrapped: dict[str, tuple[str, ...]] = {}
    for attribute in vars(metrics).values():
        if isinstance(attribute, MetricWrapperBase):
            labels = _label_names(attribute)
            for family in attribute.describe():
                wrapped[family.name] = labels or ()
    out = []
    for family in registry.collect():
        labels = _label_names(family)
        if labels is None:
            if family.name not in wrapped:
                raise ValueError(
                    f"{program}: {family.name}: its label names are unknown (declare it as an "
                    "attribute of the metrics class)"
                )
            labels = wrapped[family.name]
        name = f"{family.name}_total" if family.type == "counter" else family.name
        out.append(Declared(name, family.type, labels, family.documentation))
    return out


def markdown(program: str) -> str:
    rows = (
        (f"`{m.name}`", m.type, ", ".join(f"`{label}`" for label in m.labels), docsections.cell(m.help))
        for m in declared(program)
    )
    return docsections.table(("metric", "type", "labels", "meaning"), rows)


REFERENCE = docsections.Reference(
    tag=TAG,
    document=DOCUMENT,
    names=tuple(PROGRAMS),
    markdown=markdown,
    description="Self-metrics reference generated from the metrics' declarations",
)
section = REFERENCE.section


def main(argv: Sequence[str] = ()) -> None:
    REFERENCE.main(argv, prog="python -m testkit.metricsdoc")


if __name__ == "__main__":
    main(sys.argv[1:])
