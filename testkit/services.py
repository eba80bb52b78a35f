"""Real mosquitto / Prometheus / VictoriaMetrics processes on free loopback ports, for the integration
tests, the benches and the demo.

Every service runs in its own directory (config, data, ``<name>.log`` with stdout+stderr), in its own
process group, and listens on 127.0.0.1 only.  ``start()`` waits until the service is really ready
(the listening socket belongs to *our* process and the readiness probe passes) and raises
``ServiceError`` with the log tail otherwise.  The fixtures in ``tests/conftest.py`` (via
``ServiceFactory``) always reap them; so does atexit, and the kernel if the Python process itself is
SIGKILLed (see ``die_with_parent``, also used for the benches' other child processes).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import requests
import urllib3.exceptions
import yaml

from schemas.model import STALE_NAN

LOOPBACK = "127.0.0.1"

# labelset (``__name__`` included) -> [(timestamp_ms, value), ...] in time order
RawSamples = dict[frozenset[tuple[str, str]], list[tuple[int, float]]]

T = TypeVar("T")
S = TypeVar("S", bound="ManagedProcess")


class ServiceError(RuntimeError):
    """A service could not be started, or an API call to it failed."""


class BinaryMissing(ServiceError):
    """The service's executable is not installed; the message names the Debian package."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (``start()`` retries if it gets taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def now_ms() -> int:
    """Wall-clock time in ms, as samples are stamped."""
    return int(time.time() * 1000)


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    Raises ``TimeoutError`` naming ``message`` after ``timeout`` seconds.  Exceptions raised by the
    predicate propagate: swallowing them would turn a bug into a slow, misleading timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for: {message}")
        time.sleep(interval)


def find_binary(default_path: str, package: str) -> str:
    if os.access(default_path, os.X_OK):
        return default_path
    found = shutil.which(Path(default_path).name)
    if found:
        return found
    raise BinaryMissing(
        f"{default_path} not found (nor {Path(default_path).name} on PATH): "
        f"install the Debian package '{package}' (apt-get install {package})"
    )


def _listening_inode(port: int) -> str | None:
    """Inode of the socket listening on 127.0.0.1:port, from /proc/net/tcp (None if none)."""
    # /proc/net/tcp prints the address as a host-order u32 and the port as %04X.
    want = f"{int.from_bytes(socket.inet_aton(LOOPBACK), sys.byteorder):08X}:{port:04X}"
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1] == want and fields[3] == "0A":  # 0A = LISTEN
                return fields[9]
    return None


def _owns_listener(pid: int, port: int) -> bool:
    """Whether ``pid`` holds the socket listening on 127.0.0.1:port.

    Guards against the free_port() race the other way round: if someone else took the port, a
    readiness probe alone would happily talk to *their* server.  Without /proc (not Linux) we can't
    tell and trust the probe.
    """
    if not os.path.exists("/proc/net/tcp"):
        return True
    inode = _listening_inode(port)
    if inode is None:
        return False
    target = f"socket:[{inode}]"
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):  # fds come and go while we look
            if os.readlink(f"{fd_dir}/{fd}") == target:
                return True
    return False


class _BindFailed(Exception):
    pass


_SETPRIV = shutil.which("setpriv")  # util-linux, Essential on Debian


def die_with_parent(argv: list[str]) -> list[str]:
    """Prefix argv so the kernel SIGKILLs the process if this Python process dies (setpriv execs: same pid).

    Covers what neither fixtures nor atexit can: pytest being SIGKILLed, or os._exit() from
    pytest-timeout's thread method.  Only from the main thread: PR_SET_PDEATHSIG fires when the
    *thread* that forked the child exits, which would kill services started from short-lived threads.
    """
    if _SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return argv
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]


# Services still running; killed at interpreter exit in case some code path skipped teardown.
_LIVE: set[ManagedProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    for service in list(_LIVE):
        service.kill()


class ManagedProcess:
    """One server process listening on 127.0.0.1:``port``; subclasses provide command and probe."""

    name: ClassVar[str]
    default_binary: ClassVar[str]
    package: ClassVar[str]
    start_timeout: float = 30.0
    stop_grace: float = 10.0  # seconds between SIGTERM and SIGKILL
    bind_attempts: int = 3

    def __init__(self, tmpdir: str | os.PathLike[str], port: int | None = None) -> None:
        self.binary = find_binary(self.default_binary, self.package)  # fail before creating anything
        self.dir = Path(tmpdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / f"{self.name}.log"
        self.host = LOOPBACK
        # Only a port we picked ourselves may be replaced when it turns out to be taken.
        self._port_chosen = port is None
        self.port = free_port() if port is None else port
        self.startup_seconds: float | None = None  # time from spawn to ready, of the last start
        self._proc: subprocess.Popen[bytes] | None = None

    # -- subclass hooks -------------------------------------------------------------------------

    def command(self) -> list[str]:
        """argv for the current ``self.port``; may (re)write config files first."""
        raise NotImplementedError

    def probe(self) -> bool:
        """Readiness beyond "our process listens on the port"; default: accepts a TCP connection."""
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=1):
            return True
        return False

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def is_running(self) -> bool:
        return self._proc is not None and self._exit_status() is None

    def start(self) -> Self:
        if self._proc is not None:
            raise ServiceError(f"{self.name} is already running (pid {self._proc.pid})")
        attempts = self.bind_attempts if self._port_chosen else 1
        for attempt in range(1, attempts + 1):
            try:
                self._spawn_and_wait()
                return self
            except _BindFailed:
                if attempt == attempts:
                    raise ServiceError(self._failure("could not bind: address already in use")) from None
                self.port = free_port()
        raise AssertionError("unreachable")

    def stop(self, grace: float | None = None) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; return the exit code."""
        return self._terminate(self.stop_grace if grace is None else grace)

    def kill(self) -> int | None:
        """SIGKILL the process group at once (crash simulation); return the exit code."""
        return self._terminate(0.0)

    def restart(self, *, graceful: bool = True) -> Self:
        """Stop (or kill, if not ``graceful``) and start again on the same port and data dir."""
        if graceful:
            self.stop()
        else:
            self.kill()
        # The port is ours to reuse: a new one would break clients configured with the old one.
        chosen, self._port_chosen = self._port_chosen, False
        try:
            return self.start()
        finally:
            self._port_chosen = chosen

    def log_tail(self, lines: int = 50) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))  # logs of busy brokers get big
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return "(no log file)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.host}:{self.port} pid={self.pid} dir={self.dir}>"

    # -- internals ------------------------------------------------------------------------------

    def _spawn_and_wait(self) -> None:
        argv = self.command()
        with open(self.log_path, "ab") as log:
            log.write(f"=== {time.strftime('%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            log.flush()
            log_offset = log.tell()
            started = time.monotonic()
            self._proc = subprocess.Popen(
                die_with_parent(argv),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group, so killpg() takes everything it spawns
            )
        _LIVE.add(self)
        deadline = started + self.start_timeout
        while True:
            status = self._exit_status()
            if status is not None:
                self._terminate(0.0)
                with open(self.log_path, "rb") as log:
                    log.seek(log_offset)
                    output = log.read().decode(errors="replace")
                if "address already in use" in output.lower():
                    raise _BindFailed()
                raise ServiceError(self._failure(f"exited with status {status} before becoming ready"))
            if _owns_listener(self._proc.pid, self.port) and self.probe():
                self.startup_seconds = time.monotonic() - started
                return
            if time.monotonic() >= deadline:
                self._terminate(0.0)
                raise ServiceError(self._failure(f"not ready after {self.start_timeout:g}s"))
            time.sleep(0.02)

    def _exit_status(self) -> int | None:
        """Exit status (-N: killed by signal N) if the process has exited, without reaping it.

        Not reaping keeps its pid, and so its process group id, from being reused before
        ``_terminate`` has sent the final killpg().
        """
        assert self._proc is not None
        try:
            result = os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped
            return self._proc.returncode if self._proc.returncode is not None else -1
        if result is None:
            return None
        return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status

    def _terminate(self, grace: float) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            if grace > 0 and self._exit_status() is None:
                os.killpg(pgid, signal.SIGTERM)
                deadline = time.monotonic() + grace
                while self._exit_status() is None and time.monotonic() < deadline:
                    time.sleep(0.02)
            # The leader is not reaped yet (waitid WNOWAIT), so the group id cannot have been reused:
            # this SIGKILL reaches only our processes, including any the leader left behind.
            os.killpg(pgid, signal.SIGKILL)
        returncode = proc.wait()
        self._proc = None
        _LIVE.discard(self)
        with contextlib.suppress(OSError), open(self.log_path, "ab") as log:  # dir may be gone at exit
            log.write(f"=== {time.strftime('%H:%M:%S')} exited with {returncode}\n".encode())
        return returncode

    def _failure(self, what: str) -> str:
        return (
            f"{self.name} on {self.host}:{self.port} {what}.\n"
            f"Last 50 lines of {self.log_path}:\n{self.log_tail(50)}"
        )

    def _http_ok(self, path: str) -> bool:
        try:
            return self.http_get(path, timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def http_get(self, path: str, **kwargs: Any) -> requests.Response:
        """``GET path`` from this service as a client it lets in (its TLS and credentials, if any)."""
        return requests.get(f"http://{self.host}:{self.port}{path}", **kwargs)


class HttpService(ManagedProcess):
    """A ``ManagedProcess`` serving HTTP at ``url``; ready when ``GET <health_path>`` answers 200."""

    health_path: ClassVar[str]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Its own metrics, in the Prometheus text format."""
        return f"{self.url}/metrics"

    def probe(self) -> bool:
        return self._http_ok(self.health_path)


class Mosquitto(ManagedProcess):
    """mosquitto 2.0 broker with anonymous access on 127.0.0.1:``port``.

    ``extra_conf`` lines are appended to the generated config.  With ``persistence`` the db is only
    written on clean shutdown and every ``autosave_interval`` (default 1800 s), so ``kill()`` loses
    sessions and queued messages; for crash tests pass ``extra_conf="autosave_interval 1"`` and give
    it a second or two before the kill.
    """

    name = "mosquitto"
    default_binary = "/usr/sbin/mosquitto"
    package = "mosquitto"

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        port: int | None = None,
        persistence: bool = False,
        extra_conf: str = "",
        *,
        max_inflight_messages: int = 20,
    ) -> None:
        super().__init__(tmpdir, port)
        self.persistence = persistence
        self.extra_conf = extra_conf
        self.max_inflight_messages = max_inflight_messages
        self.conf_path = self.dir / "mosquitto.conf"
        self.data_dir = self.dir / "data"

    def command(self) -> list[str]:
        lines = [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            f"max_inflight_messages {self.max_inflight_messages}",
            # Default is 1000: too few for a persistent session whose subscriber is away for a while.
            "max_queued_messages 100000",
            # stderr is our log file; unlike "log_dest file" it also gets errors before config is read.
            "log_dest stderr",
            "log_timestamp_format %H:%M:%S",
        ]
        if os.geteuid() == 0:
            # As root mosquitto drops to user "mosquitto", which can't write our 0700 tmp dirs.
            lines.append("user root")
        if self.persistence:
            self.data_dir.mkdir(exist_ok=True)
            lines += ["persistence true", f"persistence_location {self.data_dir}/"]
        self.conf_path.write_text("\n".join(lines) + "\n" + self.extra_conf + "\n")
        return [self.binary, "-c", str(self.conf_path)]


class Prometheus(HttpService):
    """Prometheus 2.4x with the remote-write receiver on, no scrape jobs.

    With ``tls`` (a certificate and key file) it serves HTTPS (with ``client_ca`` it wants a client
    certificate that CA signed), with ``users`` ({name: password}) it wants
    basic auth on every endpoint, remote write included (``--web.config.file``, bcrypt hashes): a
    receiver behind TLS and auth. ``http_get`` and ``query`` let themselves in.

    ``ooo_window`` is measured back from the newest sample of *any* series in the head, not per
    series.  2.42 answers 400 to "out of order sample"/"out of bounds"/"duplicate sample for
    timestamp" (same timestamp, other value) but 500 to "too old sample" (older than the window).
    """

    name = "prometheus"
    default_binary = "/usr/bin/prometheus"
    package = "prometheus"
    health_path = "/-/ready"

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        port: int | None = None,
        ooo_window: str | None = "2h",
        extra_flags: Sequence[str] = (),
        scrape_configs: Sequence[Mapping[str, Any]] = (),
        *,
        tls: tuple[str, str] | None = None,
        users: Mapping[str, str] | None = None,
        client_ca: str | None = None,
        client_cert: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(tmpdir, port)
        self.tls = tls
        self.users = dict(users or {})
        self.client_ca = client_ca
        # The certificate and key http_get shows when the receiver wants one.
        self.client_cert = client_cert
        self.web_config_path = self.dir / "web.yml"
        self.ooo_window = ooo_window
        self.extra_flags = tuple(extra_flags)
        # Prometheus `scrape_configs` entries (jobs), written as given; none by default.
        self.scrape_configs = [dict(job) for job in scrape_configs]
        self.config_path = self.dir / "prometheus.yml"
        self.data_dir = self.dir / "data"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def remote_write_url(self) -> str:
        return f"{self.url}/api/v1/write"

    def http_get(self, path: str, **kwargs: Any) -> requests.Response:
        if self.users:
            kwargs.setdefault("auth", next(iter(self.users.items())))
        if self.client_ca:
            kwargs.setdefault("cert", self.client_cert)
        with warnings.catch_warnings():
            # The test's own receiver, on loopback: its certificate is not what is tested here.
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
            return requests.get(f"{self.url}{path}", verify=False, **kwargs)

    def _web_flags(self) -> list[str]:
        if not self.tls and not self.users:
            return []
        import bcrypt  # only tests of a receiver behind auth need it

        web: dict[str, Any] = {}
        if self.tls:
            web["tls_server_config"] = {"cert_file": self.tls[0], "key_file": self.tls[1]}
            if self.client_ca:
                web["tls_server_config"] |= {
                    "client_ca_file": self.client_ca,
                    "client_auth_type": "RequireAndVerifyClientCert",
                }
        if self.users:
            web["basic_auth_users"] = {
                name: bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
                for name, password in self.users.items()
            }
        self.web_config_path.write_text(yaml.safe_dump(web))
        return [f"--web.config.file={self.web_config_path}"]

    def command(self) -> list[str]:
        config = "global:\n  scrape_interval: 15s\n  evaluation_interval: 15s\n"
        if self.ooo_window is not None:
            # Without this window (Prometheus >= 2.39) any sample older than its series' newest one
            # is rejected with "out of order sample".
            config += f"storage:\n  tsdb:\n    out_of_order_time_window: {self.ooo_window}\n"
        if self.scrape_configs:
            config += yaml.safe_dump({"scrape_configs": self.scrape_configs}, sort_keys=False)
        self.config_path.write_text(config)
        return [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--web.listen-address={self.host}:{self.port}",
            "--web.enable-remote-write-receiver",
            *self._web_flags(),
            *self.extra_flags,
        ]

    def query(self, promql: str, at: float | None = None) -> dict[str, Any]:
        """``/api/v1/query``; returns the ``data`` member (resultType, result)."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        resp = self.http_get("/api/v1/query", params=params, timeout=30)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
            raise ServiceError(f"query {promql!r} failed: HTTP {resp.status_code} {resp.text[:500]}")
        return body["data"]

    def raw_samples(self, selector: str, lookback: str = "2h", at: float | None = None) -> RawSamples:
        """Stored samples of every series matching ``selector`` in ``[at - lookback, at]``.

        A range selector returns raw samples, unlike an instant query.  Staleness markers are not
        returned (PromQL drops them), and ``at`` defaults to the server's now: samples written with
        future timestamps need an explicit ``at``.
        """
        data = self.query(f"{selector}[{lookback}]", at)
        if data["resultType"] != "matrix":
            raise ServiceError(f"expected a matrix for {selector!r}, got {data['resultType']}")
        out: RawSamples = {}
        for series in data["result"]:
            key = frozenset(series["metric"].items())
            # Timestamps are exact decimal seconds with 3 fraction digits; values are Go's shortest
            # round-trip formatting ("NaN", "+Inf", "-Inf" included), so float() is exact.
            out[key] = [(round(ts * 1000), float(value)) for ts, value in series["values"]]
        return out


class VictoriaMetrics(HttpService):
    """Single-node VictoriaMetrics 1.7x accepting remote write at ``/api/v1/write``."""

    name = "victoria-metrics"
    default_binary = "/usr/bin/victoria-metrics"
    package = "victoria-metrics"
    health_path = "/health"

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        port: int | None = None,
        extra_flags: Sequence[str] = (),
    ) -> None:
        super().__init__(tmpdir, port)
        self.extra_flags = tuple(extra_flags)
        self.data_dir = self.dir / "data"

    @property
    def remote_write_url(self) -> str:
        return f"{self.url}/api/v1/write"

    def command(self) -> list[str]:
        return [
            self.binary,
            f"-httpListenAddr={self.host}:{self.port}",
            f"-storageDataPath={self.data_dir}",
            # Samples older than now - retentionPeriod are dropped silently (default: 1 month).
            "-retentionPeriod=100y",
            # Queries must see data just written (also backfilled data) rather than cached results
            # or results that hide the last 30 s.
            "-search.disableCache",
            "-search.latencyOffset=0s",
            *self.extra_flags,
        ]

    def flush(self) -> None:
        """Make everything written so far visible to searches (VM buffers rows for up to ~1 s).

        Visible, not durable: 1.79 keeps recent parts in memory, so a kill() within ~5 s of a write
        still loses it; stop() (SIGTERM) does not.
        """
        resp = requests.get(f"{self.url}/internal/force_flush", timeout=30)
        if resp.status_code != 200:
            raise ServiceError(f"force_flush failed: HTTP {resp.status_code} {resp.text[:500]}")

    def raw_samples(self, match: str, start_ms: int | None = None, end_ms: int | None = None) -> RawSamples:
        """Stored samples of every series matching ``match`` in ``[start_ms, end_ms]``, via /api/v1/export.

        VM stores values as decimals, so they are not bit-exact (about 12 significant digits).  It drops
        plain NaNs on ingestion and keeps staleness markers, which come back as ``STALE_NAN``.
        """
        params = {"match[]": match}
        if start_ms is not None:
            params["start"] = f"{start_ms / 1000:.3f}"  # VM reads these as seconds, even 13-digit ones
        # The default end is the server's now, which would hide future samples; VM accepts up to now+2d.
        end = end_ms / 1000 if end_ms is not None else time.time() + 3 * 86400
        params["end"] = f"{end:.3f}"
        resp = requests.get(f"{self.url}/api/v1/export", params=params, timeout=60)
        if resp.status_code != 200:
            raise ServiceError(f"export {match!r} failed: HTTP {resp.status_code} {resp.text[:500]}")
        out: RawSamples = {}
        for line in resp.text.splitlines():
            if line.strip():
                key, samples = _parse_export_line(line)
                # One series may span several lines (one per storage block): merge, then sort.
                out.setdefault(key, []).extend(samples)
        for samples in out.values():
            samples.sort(key=lambda s: s[0])  # stable: duplicates (VM keeps them) stay in write order
        return out


class ServiceFactory:
    """Starts services in fresh directories under ``tmp_path`` and reaps them all at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self._tmp_path = tmp_path
        self.started: list[ManagedProcess] = []

    def __call__(self, cls: type[S], **kwargs: Any) -> S:
        workdir = self._tmp_path / f"{cls.name}-{sum(type(s) is cls for s in self.started)}"
        try:
            service = cls(workdir, **kwargs)
        except BinaryMissing as exc:
            missing = str(exc)
        else:
            self.started.append(service)  # before start(): a half-started process is reaped too
            return service.start()
        import pytest  # only here: the benches and the demo use this module without pytest

        pytest.fail(missing, pytrace=False)  # outside the except: no "during handling of" noise

    def stop_all(self) -> None:
        errors: list[Exception] = []
        for service in reversed(self.started):
            try:
                service.stop()
            except Exception as exc:  # still stop the others
                errors.append(exc)
        if errors:
            raise errors[0]


# The tail of an export line.  Not plain JSON: values may be NaN, null, +Inf or -Inf.
_EXPORT_TAIL = re.compile(r',"values":\[(?P<values>[^\]]*)\],"timestamps":\[(?P<timestamps>[^\]]*)\]\}\s*$')


def _parse_export_line(line: str) -> tuple[frozenset[tuple[str, str]], list[tuple[int, float]]]:
    tail = _EXPORT_TAIL.search(line)
    if tail is None:
        raise ServiceError(f"unexpected /api/v1/export line: {line[:500]}")
    # Label values are JSON strings, which can't contain the raw quote that starts the tail.
    metric: dict[str, str] = json.loads(line[: tail.start()] + "}")["metric"]
    values = [_export_value(v) for v in tail["values"].split(",")] if tail["values"] else []
    timestamps = [int(t) for t in tail["timestamps"].split(",")] if tail["timestamps"] else []
    if len(values) != len(timestamps):
        raise ServiceError(f"export line with {len(values)} values but {len(timestamps)} timestamps")
    return frozenset(metric.items()), list(zip(timestamps, values, strict=True))


def _export_value(token: str) -> float:
    # VM drops ordinary NaNs when ingesting, so a NaN it returns is a staleness marker; 1.79 prints
    # one as "NaN" or, in a block that also holds other values, as "null".
    if token in ("NaN", "null"):
        return STALE_NAN
    return float(token)  # handles "+Inf", "-Inf", "1e-05", "0.00001"
