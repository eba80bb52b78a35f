"""The wire format's golden vectors: fixed inputs, their exact bytes, and what a decoder must make of them.

The data files are the contract (``<name>.bin`` wire bytes beside ``<name>.json``, the decoded view or
the refusal reason; format version 3 in ``v3/``): any implementation of ``schemas/wire-format.md``
must decode them the same way, and ours must also encode the batches to the same bytes.  The code
makes them, in one direction:

- ``vectors``: the batches, ack, status and invalid vectors of versions 1 and 2, and the helpers that
  craft what the encoder refuses to write (raw envelopes, replaced v2 streams, decompression bombs);
- ``vectors_v3``: the version 3 vectors (key frames, stream chains, state messages), from the same
  batches and helpers;
- ``make_golden``: writes both sets (``python -m schemas.golden.make_golden``).

The tests (``tests/test_codec*.py``) read the files and import ``vectors`` and ``vectors_v3`` for the
batches and helpers, and check that the control vectors on disk are what ``vectors`` makes.
"""
