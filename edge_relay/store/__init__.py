"""Store: every batch waits here, durable, until the cloud acknowledges it.

- ``spool``: the SQLite file (WAL) and its tables, one module each: batches by seq with a CRC per row,
  staged window cycles, the loss ledger's rows, integers kept across restarts, the flight recorder's
  blocks; recovery from a corrupt file; the uplink's narrow view (``SendQueue``, ``InFlight``).
- ``sink``: ``SpoolSink``, the one place that writes batches and staged cycles into the spool and
  handles a full spool (make room by evicting the oldest backlog, try once more, else ledger the loss).
- ``retention``: the spool's caps by bytes and age: degrade the oldest backlog (re-downsample) before
  evicting it, every eviction in the ledger with its series, range and count.
- ``held``: how many samples the budget's open aggregation windows hold, so that a kill -9 leaves them
  in the ledger (``open_window_at_kill``) instead of nowhere.
- ``recent``: the batches just spooled, decoded, for the uplink's stream coder (it decodes a row only
  when its batch is no longer here).

The spool stores opaque payloads (wire envelopes, sent as they are) and knows nothing of MQTT, budgets
or encodings; what decides a row's fate (its seq, time range, size) lives in columns the caps read.
"""
