"""Encode: a cycle's shaped scrapes into wire batches, and into the spool.

- ``batches``: ``BatchEncoder`` cuts scrapes into ``Batch`` objects and encodes them as wire envelopes
  (v1, or the columnar v2; ``schemas.codec``), each within ``batch.max_bytes`` (a scrape or a window too
  big for one message is split by series, never by sample); the cheap ``stage`` form of a cycle waiting
  in a window; ``dedupe_window`` (one sample per series and timestamp).
- ``window``: ``BatchWindow``, a budget's cycles collected into one batch per window, each cycle staged
  durably in the spool as it arrives, so a kill -9 inside the window loses nothing.
- ``lanes``: ``Lanes``, which way a cycle goes: the live lane (batches of the cycle, published at once)
  or the window; what neither can take is in the ledger with its reason.

Everything goes into the spool through ``store.sink``; stream coding (v3) happens later, at
publication, in ``uplink.stream``, so the spool always holds self-contained batches.
"""
