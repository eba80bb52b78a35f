"""Bad data, hostile peers and what they cost (issue 12), as reusable pieces for the fault bench.

- ``TricklingExporter``: an HTTP endpoint that announces a large body and then sends one byte every
  ``every`` seconds until the client hangs up (a stuck or hostile exporter, for scrape deadlines).
- ``TimedScriptedExporter``: a ``testkit.exporters.ScriptedExporter`` that also remembers when each
  request was served, so a check can stop at the end of an evaluation window.
- ``qos0_flood``: a client that is not the relay publishing many QoS 0 messages to one topic.
- ``hostile_batch``: a well-formed batch (wire format) of some node, to flood with.
- ``expansion_batch``: a small legal batch of some node that stands for a huge remote-write request
  (many series sharing a few long label values), and ``qos1_publish`` to send it with QoS 1.
- ``numbered_exposition``: a text exposition of ``a_N 1`` lines (unique names) of a given size.
- ``Faketime``: libfaketime under a process, its realtime clock stepped through a timestamp file
  (the monotonic clock untouched).
- ``ledger_by_series``: the relay's loss ledger by (reason, series), from ``edge-relay ledger``.
- ``dead_letters_by_job``: the samples in cloud-ingest's dead-letter store, by (job, metric name).
- ``spool_waiting``: what ``edge-relay ledger`` says is waiting in a spool (batches, samples).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from testkit.exporters import CONTENT_TYPE, ScriptedExporter


class TricklingExporter:
    """Status line and headers announcing ``content_length`` bytes at once, then ``byte`` every
    ``every`` seconds (valid exposition bytes: a comment line that never ends) until the client
    closes. ``requests`` counts the requests read."""

    def __init__(self, every: float = 0.5, content_length: int = 1_000_000, byte: bytes = b"#") -> None:
        self.every = every
        self.content_length = content_length
        self.byte = byte
        self.requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/metrics"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                with self._lock:
                    self.requests += 1
                head = (
                    f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\n"
                    f"Content-Length: {self.content_length}\r\n\r\n"
                )
                conn.sendall(head.encode())
                for _ in range(self.content_length):
                    if self._stop.wait(self.every):
                        return
                    conn.sendall(self.byte)
            except OSError:
                pass  # the scraper hung up: what this exporter is for

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> TricklingExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TimedScriptedExporter(ScriptedExporter):
    """``ScriptedExporter(body_for)`` that records (request number, unix ms) as each body is made."""

    def __init__(self, body_for: Callable[[int], str | bytes]) -> None:
        self.served: list[tuple[int, int]] = []
        lock = threading.Lock()

        def timed(n: int) -> str | bytes:
            body = body_for(n)
            with lock:
                self.served.append((n, int(time.time() * 1000)))
            return body

        super().__init__(timed)


def hostile_batch(
    node: str, seq: int, *, cluster: str = "test", series: int = 5, job: str = "hostile"
) -> bytes:
    """A valid wire-format batch of ``node`` with ``series`` samples stamped now."""
    from schemas import codec
    from schemas.model import Batch, ScrapeBlock

    labelsets = [
        tuple(sorted({"__name__": "hostile_metric", "job": job, "node": node, "i": str(i)}.items()))
        for i in range(series)
    ]
    block = ScrapeBlock(int(time.time() * 1000), array("I", range(series)), array("d", [float(seq)] * series))
    return codec.encode_batch(Batch(cluster, node, seq, labelsets, [block]))


def qos0_flood(
    port: int,
    topic: str,
    payloads: list[bytes],
    *,
    client_id: str = "hostile-flooder",
    host: str = "127.0.0.1",
) -> int:
    """Connect as ``client_id`` (MQTT 5, anonymous) and publish every payload to ``topic`` with QoS 0
    as fast as the client goes; returns how many the client handed to the socket."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.max_queued_messages_set(0)
    client.connect(host, port, keepalive=30)
    client.loop_start()
    try:
        sent = 0
        for payload in payloads:
            info = client.publish(topic, payload, qos=0)
            if info.rc == mqtt.MQTT_ERR_SUCCESS:
                sent += 1
        deadline = time.monotonic() + 10
        while client.want_write() and time.monotonic() < deadline:  # let the last ones out
            time.sleep(0.05)
        time.sleep(0.2)
        return sent
    finally:
        client.disconnect()
        client.loop_stop()


def expansion_batch(
    node: str,
    seq: int,
    *,
    cluster: str = "test",
    series: int = 50_000,
    value_bytes: int = 4000,
    t_ms: int | None = None,
) -> bytes:
    """A legal wire-format batch of ``node`` (far under the payload cap: tens of KiB) whose ``series``
    series share four label values of ``value_bytes`` bytes: as a remote-write request every series
    repeats them, ``series x 4 x value_bytes`` bytes (800 MB with the defaults); as
    ``tests/cloud/test_ingest_bounds.py``'s ``shared_values_batch``."""
    from schemas import codec
    from schemas.model import Batch, ScrapeBlock

    shared = {name: name * value_bytes for name in ("a", "b", "c", "d")}
    labelsets = [
        tuple(
            sorted(
                {
                    "__name__": "expansion_metric",
                    "cluster": cluster,
                    "node": node,
                    "i": str(k),
                    **shared,
                }.items()
            )
        )
        for k in range(series)
    ]
    t = int(time.time() * 1000) if t_ms is None else t_ms
    block = ScrapeBlock(t, array("I", range(series)), array("d", [1.0] * series))
    return codec.encode_batch(Batch(cluster, node, seq, labelsets, [block]))


def qos1_publish(
    port: int,
    topic: str,
    payloads: list[bytes],
    *,
    client_id: str = "hostile-publisher",
    host: str = "127.0.0.1",
    every: float = 0.0,
    timeout: float = 10.0,
) -> int:
    """Connect as ``client_id`` (MQTT 5, anonymous) and publish each payload to ``topic`` with QoS 1,
    ``every`` seconds apart, each acknowledged by the broker (PUBACK) before the next; returns how
    many were acknowledged."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.connect(host, port, keepalive=30)
    client.loop_start()
    try:
        acked = 0
        for i, payload in enumerate(payloads):
            if i and every:
                time.sleep(every)
            info = client.publish(topic, payload, qos=1)
            info.wait_for_publish(timeout)
            if info.is_published():
                acked += 1
        return acked
    finally:
        client.disconnect()
        client.loop_stop()


def numbered_exposition(size_bytes: int, value: str = "1") -> bytes:
    """A text exposition of ``a_0 1``, ``a_1 1``, ... (every name its own series), just over
    ``size_bytes`` long."""
    lines: list[str] = []
    total = 0
    n = 0
    tail = f" {value}\n"
    while total < size_bytes:
        line = f"a_{n}{tail}"
        lines.append(line)
        total += len(line)
        n += 1
    return "".join(lines).encode()


# Where to look for libfaketime: upstream's ``make install``, then Debian's package faketime.
LIBFAKETIME = (
    "/usr/local/lib/faketime/libfaketime.so.1",
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
)


class Faketime:
    """libfaketime (``LD_PRELOAD``) for a child process whose realtime clock is stepped by rewriting
    ``FAKETIME_TIMESTAMP_FILE`` (a relative offset such as ``-600``, read again on every call:
    ``FAKETIME_NO_CACHE=1``); ``FAKETIME_DONT_FAKE_MONOTONIC=1`` leaves CLOCK_MONOTONIC alone.

    ``lib`` defaults to ``$BENCH_LIBFAKETIME``, else the first of ``LIBFAKETIME`` that exists (else
    Debian's path). ``problem()`` runs the relay's Python
    under it and says why it cannot be used (None: it can): not installed; or libfaketime 0.9.10
    (Debian bookworm's), whose ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` with the monotonic
    clock left alone passes the kernel a bad time, so Python 3.11's ``time.sleep`` fails with EINVAL
    (wolfcw/libfaketime#426, fixed in 0.9.11)."""

    def __init__(self, offset_file: Path, lib: str | None = None) -> None:
        found = next((p for p in LIBFAKETIME if Path(p).exists()), LIBFAKETIME[-1])
        self.lib = lib or os.environ.get("BENCH_LIBFAKETIME") or found
        self.offset_file = offset_file
        self.offset_s = 0
        self.steps: list[tuple[int, int]] = []  # (real unix ms, new offset s)
        self.step(0, record=False)

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": self.lib,
            "FAKETIME_TIMESTAMP_FILE": str(self.offset_file),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def step(self, offset_s: int, *, record: bool = True) -> int:
        """Set the clock ``offset_s`` from the real one (atomically: write and rename); returns the real
        unix ms of the step."""
        tmp = self.offset_file.with_suffix(".tmp")
        tmp.write_text(f"{offset_s:+d}\n")
        tmp.replace(self.offset_file)
        at = int(time.time() * 1000)
        self.offset_s = offset_s
        if record:
            self.steps.append((at, offset_s))
        return at

    def problem(self, python: str = sys.executable) -> str | None:
        """None if ``python`` under this libfaketime sleeps, waits and steps as wanted, else why not."""
        if not Path(self.lib).exists():
            return f"{self.lib} not found (Debian package faketime, or set BENCH_LIBFAKETIME)"
        probe_file = self.offset_file.with_name(self.offset_file.name + ".probe")
        probe_file.write_text("-600\n")
        env = {**os.environ, **self.env(), "FAKETIME_TIMESTAMP_FILE": str(probe_file)}
        code = (
            "import threading, time\n"
            "m = time.monotonic(); time.sleep(0.05); threading.Event().wait(0.05)\n"
            "print(round(time.time() - float(input())), time.monotonic() - m < 5)\n"
        )
        try:
            out = subprocess.run(
                [python, "-c", code],
                input=f"{time.time()}\n",
                capture_output=True,
                text=True,
                env=env,
                timeout=20,
            )
        except subprocess.TimeoutExpired:
            return f"{self.lib}: the probe hung"
        finally:
            probe_file.unlink(missing_ok=True)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["?"])[-1]
            return (
                f"{self.lib}: Python's time.sleep fails under it ({last}): libfaketime 0.9.10's "
                "clock_nanosleep bug with FAKETIME_DONT_FAKE_MONOTONIC (wolfcw/libfaketime#426, fixed in "
                "0.9.11); build 0.9.11 or later and set BENCH_LIBFAKETIME"
            )
        if out.stdout.split() != ["-600", "True"]:
            return f"{self.lib}: unexpected clocks under it: {out.stdout.strip()!r} (wanted '-600 True')"
        return None


def _ledger_cmd(relay_cfg: Path, limit: int) -> str:
    return subprocess.run(
        [sys.executable, "-m", "edge_relay.cli", "ledger", "--config", str(relay_cfg), "--limit", str(limit)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def ledger_by_series(relay_cfg: Path, limit: int = 100_000) -> Counter[tuple[str, str]]:
    """``edge-relay ledger``'s entries, summed by (reason, series matcher, e.g. ``{job="x"}``)."""
    out: Counter[tuple[str, str]] = Counter()
    for line in _ledger_cmd(relay_cfg, limit).splitlines():
        # recorded (UTC) [2 words]  reason  samples  from [2 words or -]  to [2 words or -]  series
        m = re.match(r"^\S+ \S+\s+(\S+)\s+(\d+)\s+(?:\S+ \S+|-)\s+(?:\S+ \S+|-)\s+(.+)$", line)
        if m and not line.startswith(("spool ", "totals: ", "recorded")):
            out[(m.group(1), m.group(3).strip())] += int(m.group(2))
    return out


def spool_waiting(relay_cfg: Path) -> tuple[int, int]:
    """(batches, samples) waiting in the relay's spool, from ``edge-relay ledger``'s first line."""
    first = _ledger_cmd(relay_cfg, 1).splitlines()[0]
    m = re.search(r": (\d+) batches \((\d+) samples\) waiting", first)
    if not m:
        raise RuntimeError(f"unexpected ledger output: {first!r}")
    return int(m.group(1)), int(m.group(2))


def dead_letters_by_job(path: Path) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """(samples by (job, metric name), letters by reason) in a dead-letter store; a letter with several
    reasons counts once for each; a reason is its slug (``future_timestamp``) or ``HTTP <code>: <text>``."""
    from cloud_ingest.outcome.deadletters import DeadLetterStore
    from schemas import codec
    from schemas.model import metric_name

    samples: Counter[tuple[str, str]] = Counter()
    reasons: Counter[str] = Counter()
    if not path.exists():
        return samples, reasons
    store = DeadLetterStore(path)
    try:
        for letter in store.list(1_000_000):
            for part in (letter.reason or "?").split("; "):  # one letter may hold several refusals
                reasons[part if part.startswith("HTTP") else part.split(":")[0]] += 1
            stored = store.payload(letter.id)
            if stored is None:
                continue
            batch = codec.decode_batch(stored[1])
            for block in batch.scrapes:
                for i in block.series:
                    labels = dict(batch.labelsets[i])
                    samples[(labels.get("job", ""), metric_name(batch.labelsets[i]))] += 1
    finally:
        store.close()
    return samples, reasons
