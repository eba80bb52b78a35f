"""``cloud-ingest check-config``: validate a config file as ``run`` would, and show it with every default.

``validate`` is what ``cloud-ingest run`` checks at start-up before it builds anything (``app.run``
calls it), so ``check-config`` fails exactly when ``run`` would, with the same messages (exit 2):

- the config file itself (``settings.load``: schema, topic prefix, ranges, remote-write headers,
  credentials and relabel rules of each target);
- each remote-write target's ``url``: http(s) with a host and a valid port, as the remote-write client
  requires; its credentials file readable and its TLS files loadable (``check_connection_files``);
- the MQTT TLS files: readable, PEM, and loadable as paho will load them (``mqtt_tls.check_tls``);
- the dead-letter store: its directory writable or creatable, the file (if there) writable;
- ``metrics.listen``: a host:port the metrics server can bind (not whether the port is free).

``--config-only`` leaves out what depends on the machine (TLS and credentials files, dead-letter
directory).
"""

from __future__ import annotations

import argparse
import functools
import urllib.parse
from collections.abc import Callable

import yaml

from cloud_ingest import settings
from cloud_ingest.sinks.remote_write.connection import check_connection_files
from relay_common import preflight
from relay_common.config import ConfigError
from relay_common.mqtt_tls import check_tls


def check_remote_write_url(url: str, source: str, key: str = "remote_write") -> None:
    """What ``RemoteWriteClient`` refuses (with a ValueError, at start-up) and what requests would fail
    on at every send (a port out of range), as a configuration error."""
    where = f"{source}: key `{key}.url`"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{where}: expected http(s)://host[:port]/path, got {url!r}")
    try:
        parsed.port  # noqa: B018 - the property parses and range-checks the port
    except ValueError as e:
        raise ConfigError(f"{where}: {e} in {url!r}") from None


def validate(s: settings.Settings, *, host: bool = True) -> None:
    """Raise ConfigError with every problem ``run`` would meet at start-up (one a line)."""
    checks: list[Callable[[], object]] = []
    for t in s.remote_write_targets:
        checks.append(functools.partial(check_remote_write_url, t.url, s.source, t.connection.key))
        if host:
            checks.append(functools.partial(check_connection_files, t.connection, s.source))
    if host:
        checks.append(lambda: check_tls(s.tls, s.source, "mqtt.tls"))
        checks.append(lambda: preflight.check_writable_dir(s.dead_letter_path, "dead_letter.path", s.source))
    checks.append(lambda: preflight.check_listen(s.metrics_listen, "metrics.listen", s.source))
    preflight.collect(checks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cloud ingester config file (YAML)")
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="skip the checks of this machine (TLS files, dead-letter directory): for a config off its host",
    )


def run(args: argparse.Namespace) -> int:
    s = settings.load(args.config)
    validate(s, host=not args.config_only)
    print(yaml.safe_dump(s.raw, sort_keys=False), end="")
    scope = " (machine checks skipped)" if args.config_only else ""
    print(f"# OK: {args.config} is valid{scope} (remote write to {s.remote_write_url})")
    return 0
