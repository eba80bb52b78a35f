"""The flight recorder, and backfill requests answered from it.

- ``flight``: ``FlightRecorder`` keeps every raw scrape (before the budget shapes it) at full resolution
  for a bounded span, in blocks in the spool file's own table, always second to the unsent backlog; it
  reads a time range back for a series selector, reporting what it no longer holds.
- ``backfill``: ``CommandInbox`` (requests from the uplink thread to the relay loop, results back) and
  ``Backfiller``, which answers one request at a time from the recorder through the sink, within a
  quarter of a scrape interval of work per cycle.

The selector grammar is shared with the cloud (``relay_common.selector``), which checks an operator's
selector before it sends a request.
"""
