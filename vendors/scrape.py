"""The series the relay's scraper adds to every target, as Prometheus does: ``up`` and the scrape's
duration and sample count. No exporter serves them, but a budget class names them like an exporter's."""

from __future__ import annotations

from typing import Final

from vendors.record import Exporter, Preset

RECORD: Final = Exporter(
    name="scrape",
    presets={
        "scrape-health": Preset(
            "the series every scrape adds: up, scrape_duration_seconds, scrape_samples_scraped",
            ("up|scrape_duration_seconds|scrape_samples_scraped",),
            summary="up, scrape_duration_seconds, scrape_samples_scraped",
        ),
    },
)
