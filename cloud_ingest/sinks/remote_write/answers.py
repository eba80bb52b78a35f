"""What a remote-write receiver's answer says about a batch: written, worth retrying, a configuration
error, or a refusal of its samples.

The distinction decides whether the edge keeps data. Only a refusal of the *samples* may end as
``rejected`` (acked, so the edge deletes the row): every other error answer is the same for every batch
of every node, and treating it as a rejection would empty the fleet's spools on one misconfiguration.
"""

from __future__ import annotations

# Status codes retried besides 5xx.  408 is a server-side timeout, so transient like 5xx; upstream
# Prometheus retries only 5xx and 429.
RETRY_4XX = frozenset({408, 429})
RETRY_AFTER_STATUSES = frozenset({429, 503})
# 5xx answers that mean "never": Prometheus with an out-of-order window answers 500 "too old sample"
# for samples older than the window. Retrying forever would block the node's queue, so after a few
# identical answers the batch is rejected (dead-lettered, replayable) instead.
PERMANENT_5XX_MARKERS = ("too old sample", "out of bounds")
# A 3xx/4xx is a rejection of the *data* only with one of these statuses and a body naming a
# sample-level cause: Prometheus' "out of order sample", "out of bounds", "duplicate sample for
# timestamp", "too old sample"; Mimir's err-mimir-sample-out-of-order, -sample-timestamp-too-old,
# -sample-duplicate-timestamp, -too-far-in-future (matched with '-' and '_' read as blanks). Any other
# 3xx/4xx but 408/429 is a configuration error: a redirect, 401/403 credentials, 404/405 a wrong URL,
# 413 a body above the receiver's limit (the same body never fits, but it is valid data: the limit or
# batch.max_bytes is what to fix), a 400 naming no sample (a body it cannot decode: our bug).
SAMPLE_REJECTION_STATUSES = frozenset({400, 409, 422})
SAMPLE_REJECTION_MARKERS = (
    "out of order",
    "out of bounds",
    "duplicate sample",
    "duplicate timestamp",
    "too old",
    "too far in future",
    "too far in the future",
)


def names_bad_samples(body: bytes) -> bool:
    """Whether an error body says that samples, not the request or the receiver, are the problem."""
    text = body.decode("utf-8", errors="replace").lower().replace("-", " ").replace("_", " ")
    return any(marker in text for marker in SAMPLE_REJECTION_MARKERS)


def refuses_samples(code: int, body: bytes) -> bool:
    """A 3xx/4xx that rejects the batch's samples for good (else: a configuration error)."""
    return code in SAMPLE_REJECTION_STATUSES and names_bad_samples(body)
