"""``edge-relay check-config``: validate a config file as ``run`` would, and show it with every default.

``validate`` is what ``edge-relay run`` checks at start-up before it builds anything (``relay.run`` calls
it), so ``check-config`` fails exactly when ``run`` would, with the same messages (exit 2):

- the config file itself (``settings.load``: schema, names, targets, relabel rules);
- the budget file, with the loader ``run`` uses (``edge_relay.budget.model.load``);
- an ``nvml://local`` target: the ``pynvml`` module (the ``nvml`` extra) importable;
- the MQTT TLS files: readable, PEM, and loadable as paho will load them (``mqtt_tls.check_tls``);
- the spool: its directory writable or creatable, the file (if there) writable; nothing is created;
- ``metrics.listen``: a host:port the metrics server can bind (not whether the port is free).

``--config-only`` leaves out what depends on the machine (TLS files, spool directory), for checking a
config somewhere else than on its node (CI, a laptop); the budget file ships with the config, so it
stays in.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import yaml

from edge_relay import settings
from edge_relay.budget import model as budget_model
from edge_relay.collect import nvml
from relay_common import preflight
from relay_common.config import ConfigError
from relay_common.mqtt_tls import check_tls


def validate(s: settings.Settings, *, host: bool = True) -> None:
    """Raise ConfigError with every problem ``run`` would meet at start-up (one a line)."""
    checks: list[Callable[[], object]] = []
    if s.budget_file:
        checks.append(lambda: budget_model.load(s.budget_file))
    nvml_targets = [t.name for t in s.targets if t.kind == "nvml"]
    if nvml_targets:
        checks.append(lambda: _check_nvml(nvml_targets, s.source))
    if host:
        checks.append(lambda: check_tls(s.mqtt.tls, s.source, "mqtt.tls"))
        checks.append(lambda: preflight.check_writable_dir(s.spool_path, "spool.path", s.source))
    checks.append(lambda: preflight.check_listen(s.metrics_listen, "metrics.listen", s.source))
    preflight.collect(checks)


def _check_nvml(targets: list[str], source: str) -> None:
    # The module is part of the install (the image), not of the machine: checked with --config-only too.
    # Whether a driver and a GPU answer is left to the scrapes (`up` 0 and the error until they do).
    try:
        nvml.load_module()
    except nvml.NvmlUnavailable as e:
        raise ConfigError(f"{source}: target(s) {', '.join(targets)}: {e}") from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="edge relay config file (YAML)")
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="skip the checks of this machine (TLS files, spool directory): for a config off its node",
    )


def run(args: argparse.Namespace) -> int:
    s = settings.load(args.config)
    validate(s, host=not args.config_only)
    print(yaml.safe_dump(s.raw, sort_keys=False), end="")
    scope = " (machine checks skipped)" if args.config_only else ""
    what = f"{len(s.targets)} target(s), node {s.node}, cluster {s.cluster}"
    print(f"# OK: {args.config} is valid{scope} ({what})")
    return 0
