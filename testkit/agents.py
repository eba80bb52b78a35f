"""The two reference edge agents the benches compare ours with, as ``testkit.services`` processes.

``PrometheusAgent`` (``prometheus --enable-feature=agent``) and ``VmAgent`` (``vmagent``) scrape the
simulator's exporters with the relay's labels (``scrape_configs``: job = exporter, instance =
``<node>:<port>``) and remote-write to a URL; ``tool_version`` names the binary's version for a report.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Mapping
from typing import Any

import yaml

from testkit.services import HttpService


def duration(seconds: float) -> str:
    """A Prometheus / vmagent duration string (whole milliseconds)."""
    return f"{round(seconds * 1000)}ms"


def scrape_configs(urls: Mapping[str, str], node: str) -> list[dict[str, Any]]:
    """One job per exporter, named like the exporter, ``instance`` = ``<node>:<port>`` as the relay does."""
    out = []
    for job, url in urls.items():
        hostport = url.split("/")[2]
        port = hostport.rsplit(":", 1)[1]
        out.append(
            {
                "job_name": job,
                "metrics_path": "/" + url.split("/", 3)[3],
                "static_configs": [{"targets": [hostport], "labels": {"instance": f"{node}:{port}"}}],
            }
        )
    return out


class _Agent(HttpService):
    """Scrapes ``urls`` every ``interval`` with the relay's labels plus ``external_labels`` and
    remote-writes to ``remote_write_url``."""

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        *,
        urls: Mapping[str, str],
        interval: float,
        remote_write_url: str,
        external_labels: Mapping[str, str],
        node: str,
    ) -> None:
        super().__init__(tmpdir)
        self.remote_write_url = remote_write_url
        self.external_labels = dict(external_labels)
        self.config: dict[str, Any] = {
            "global": {"scrape_interval": duration(interval), "scrape_timeout": duration(interval * 0.8)},
            "scrape_configs": scrape_configs(urls, node),
        }


class PrometheusAgent(_Agent):
    """``prometheus --enable-feature=agent`` (WAL in tmp), retrying with at most ``max_backoff`` s."""

    name = "prometheus-agent"
    default_binary = "/usr/bin/prometheus"
    package = "prometheus"
    health_path = "/-/ready"

    def __init__(self, tmpdir: str | os.PathLike[str], *, max_backoff: float, **agent: Any) -> None:
        super().__init__(tmpdir, **agent)
        self.config_path = self.dir / "agent.yml"
        self.wal_dir = self.dir / "wal"
        self.config["global"]["external_labels"] = self.external_labels
        self.config["remote_write"] = [
            {"url": self.remote_write_url, "queue_config": {"max_backoff": duration(max_backoff)}},
        ]

    def command(self) -> list[str]:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        return [
            self.binary,
            "--enable-feature=agent",
            f"--config.file={self.config_path}",
            f"--storage.agent.path={self.wal_dir}",
            f"--web.listen-address={self.host}:{self.port}",
        ]


class VmAgent(_Agent):
    """``vmagent`` (on-disk queue in tmp)."""

    name = "vmagent"
    default_binary = "/usr/bin/vmagent"
    package = "victoria-metrics"
    health_path = "/health"

    def __init__(self, tmpdir: str | os.PathLike[str], **agent: Any) -> None:
        super().__init__(tmpdir, **agent)
        self.config_path = self.dir / "scrape.yml"
        self.queue_dir = self.dir / "remotewrite-data"

    def command(self) -> list[str]:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        return [
            self.binary,
            f"-promscrape.config={self.config_path}",
            f"-remoteWrite.url={self.remote_write_url}",
            f"-remoteWrite.tmpDataPath={self.queue_dir}",
            f"-httpListenAddr={self.host}:{self.port}",
            *(f"-remoteWrite.label={k}={v}" for k, v in self.external_labels.items()),
        ]


def tool_version(argv: list[str], package: str | None = None) -> str:
    """First line a binary prints for its version flag, or its Debian package's version if it prints
    nothing (Debian's vmagent 1.79 prints an empty ``-version``)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
        if lines:
            return lines[0]
    if package is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True, timeout=30
            )
            if out.returncode == 0 and out.stdout.strip():
                return f"(`{' '.join(argv)}` prints nothing; Debian package {package} {out.stdout.strip()})"
    return f"(`{' '.join(argv)}` prints nothing)"
