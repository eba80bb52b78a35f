"""Prometheus remote-write 1.0 (Prometheus with ``--web.enable-remote-write-receiver``, VictoriaMetrics,
Mimir), cut by job:

- ``request.py``: a batch -> the ``WriteRequest`` protobuf, encoded by hand, snappy block format; the
  bound of its size without building it; the encoded labels kept across requests (``LabelBytes``).
- ``answers.py``: what a receiver's HTTP answer says: written, worth retrying, a configuration error,
  or a refusal of the samples. Only the last may end as ``rejected``.
- ``connection.py``: how one receiver is reached, as Prometheus' ``remote_write`` names it: credentials
  (``basic_auth``, ``authorization``, ``bearer_token_file``) and TLS files re-read when they change,
  ``tls_config``, ``proxy_url``; the ``requests`` session and the ``Authorization`` header of a target.
- ``client.py``: the HTTP writer (``RemoteWriteClient``): one keep-alive session, retries with capped,
  jittered backoff and ``Retry-After``, bounded error bodies; every call returns a ``WriteOutcome``.
- ``sink.py``: the ``Sink`` (``RemoteWriteSink``): a request per batch, and a rejected one bisected
  (``cloud_ingest.isolate``) until the samples the receiver refuses are found.

Data flows request -> client -> sink; the client never sees a sink, the request never an HTTP answer;
the connection knows nothing of remote write (the client asks it for a session and a header).
"""
