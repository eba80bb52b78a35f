"""The caps on what the wire carries: :class:`Limits` and the integer range of seqs and timestamps.

The decoders check every size against these before they allocate it; the encoders check the same
ones, so a batch the edge encodes is one the cloud accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

INT64_MAX: Final = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps the decoder enforces before allocating; the encoder checks the same ones."""

    max_payload_bytes: int = 1 << 20
    max_decompressed_bytes: int = 32 << 20
    max_series: int = 200_000
    max_samples: int = 2_000_000
    max_labels_per_series: int = 64
    max_label_name_bytes: int = 256
    max_label_value_bytes: int = 4096
    # Python objects cost ~20x their msgpack bytes; these two keep a hostile body that stays under
    # max_decompressed_bytes from turning into gigabytes of label strings or empty scrape blocks.
    max_label_pairs: int = 1_000_000
    max_scrapes: int = 100_000
    max_ack_bytes: int = 256 << 10
    max_ack_results: int = 100_000
    max_status_bytes: int = 16 << 10


DEFAULT_LIMITS: Final = Limits()


def timestamp_in_range(ts: int) -> bool:
    """A timestamp (ms) the wire can carry: 0..2^63-1, the one rule for scrape and sample timestamps."""
    return 0 <= ts <= INT64_MAX
