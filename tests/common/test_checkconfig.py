"""``check-config`` says what ``run`` would say: for every class of start-up failure, the same config
makes ``run`` and ``check-config`` fail with the same message (exit 2), for both programs.

``run`` is called in-process through the real command line (``cli.main``) with the part it would build
next (``Relay`` / ``Ingester``) replaced by a tripwire, so a config ``run`` accepts is visible at once
instead of starting a relay; one case runs ``edge-relay run`` as a real subprocess as well.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cloud_ingest import app as service
from cloud_ingest import cli as cloud_cli
from edge_relay import app as relay
from edge_relay import cli as edge_cli
from edge_relay.commands import checkconfig as edge_checkconfig


class Started(Exception):
    """``run`` got past its start-up checks."""


@pytest.fixture(autouse=True)
def _tripwires(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: Any, **kwargs: Any) -> None:
        raise Started

    monkeypatch.setattr(relay, "Relay", started)
    monkeypatch.setattr(service, "Ingester", started)


def _outcome(
    main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int | str, str]:
    try:
        code: int | str = main(argv)
    except Started:
        code = "started"
    err = capsys.readouterr().err
    return code, "\n".join(line for line in err.splitlines() if " INFO " not in line)


def both(program: str, config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """(run's, check-config's) error output; asserts both refused the config with exit status 2."""
    main = edge_cli.main if program == "edge-relay" else cloud_cli.main
    run_code, run_err = _outcome(main, ["run", "--config", str(config)], capsys)
    check_code, check_err = _outcome(main, ["check-config", "--config", str(config)], capsys)
    assert (run_code, check_code) == (2, 2), (run_err, check_err)
    return run_err, check_err


# --- configs --------------------------------------------------------------------------------------------


def edge_config(tmp_path: Path, **overrides: Any) -> Path:
    cfg: dict[str, Any] = {
        "node": "n1",
        "cluster": "c1",
        "targets": [{"name": "kepler", "url": "http://127.0.0.1:28282/metrics"}],
        "spool": {"path": str(tmp_path / "spool" / "spool.db")},
        "mqtt": {"host": "127.0.0.1", "port": 1883},
        "metrics": {"listen": "127.0.0.1:0"},
    }
    for key, value in overrides.items():
        section, _, sub = key.partition("__")
        if sub:
            cfg.setdefault(section, {})[sub] = value
        else:
            cfg[section] = value
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cloud_config(tmp_path: Path, **overrides: Any) -> Path:
    cfg: dict[str, Any] = {
        "mqtt": {"host": "127.0.0.1", "port": 1883},
        "remote_write": {"url": "http://127.0.0.1:9090/api/v1/write"},
        "dead_letter": {"path": str(tmp_path / "dl" / "dead-letter.db")},
        "metrics": {"listen": "127.0.0.1:0"},
    }
    for key, value in overrides.items():
        section, _, sub = key.partition("__")
        cfg.setdefault(section, {})[sub] = value
    path = tmp_path / "ingest.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def budget(tmp_path: Path, *, rate: Any = 2000, resolution: Any = 10) -> str:
    doc = {
        "version": 1,
        "uplink": {"sustained_bytes_per_second": rate},
        "classes": [{"name": "all", "match": [{"name": ".+"}], "resolution_seconds": resolution}],
    }
    name = f"budget-{rate}-{resolution}.yaml"  # one file per variant: the cases are built together
    (tmp_path / name).write_text(yaml.safe_dump(doc))
    return name


def pem_files(tmp_path: Path) -> dict[str, Path]:
    """A self-signed certificate with its key, a second key, the first key encrypted, and a non-PEM file."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    files = {
        "cert": cert.public_bytes(serialization.Encoding.PEM),
        "key": key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        "other_key": ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        "encrypted_key": key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        ),
        "der": cert.public_bytes(serialization.Encoding.DER),
        "garbage_pem": b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n",
    }
    out = {}
    for label, data in files.items():
        out[label] = tmp_path / f"{label}.pem"
        out[label].write_bytes(data)
    return out


# --- the edge relay -----------------------------------------------------------------------------------------


def _edge_cases(tmp_path: Path) -> dict[str, tuple[dict[str, Any], str]]:
    pem = pem_files(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {
        "budget negative rate": ({"budget_file": budget(tmp_path, rate=-5)}, "sustained_bytes_per_second"),
        "budget resolution 5s": ({"budget_file": budget(tmp_path, resolution="5s")}, "resolution_seconds"),
        "budget file missing": ({"budget_file": "nope.yaml"}, "cannot read"),
        "tls ca missing": ({"mqtt__tls": {"ca_file": str(tmp_path / "nope.pem")}}, "mqtt.tls.ca_file"),
        "tls ca not pem": ({"mqtt__tls": {"ca_file": str(pem["der"])}}, "is not PEM"),
        "tls ca garbage pem": ({"mqtt__tls": {"ca_file": str(pem["garbage_pem"])}}, "no usable CA"),
        "tls key mismatch": (
            {"mqtt__tls": {"cert_file": str(pem["cert"]), "key_file": str(pem["other_key"])}},
            "cannot load client certificate",
        ),
        "tls key encrypted": (
            {"mqtt__tls": {"cert_file": str(pem["cert"]), "key_file": str(pem["encrypted_key"])}},
            "encrypted",
        ),
        "tls key without cert": (
            {"mqtt__tls": {"key_file": str(pem["key"])}},
            "without `mqtt.tls.cert_file`",
        ),
        "spool under a file": ({"spool": {"path": str(a_file / "spool.db")}}, "is not a directory"),
        "spool is a directory": ({"spool": {"path": str(tmp_path)}}, "is not a file"),
        "listen port out of range": ({"metrics": {"listen": "127.0.0.1:99999"}}, "out of range"),
        "listen host unknown": ({"metrics": {"listen": "no-such-host.invalid:9901"}}, "cannot listen on"),
        "relabel regex": (
            {
                "scrape": {
                    "metric_relabel_configs": [{"action": "drop", "source_labels": ["a"], "regex": "("}]
                }
            },
            "metric_relabel_configs",
        ),
    }


EDGE_CASES = [
    "budget negative rate",
    "budget resolution 5s",
    "budget file missing",
    "tls ca missing",
    "tls ca not pem",
    "tls ca garbage pem",
    "tls key mismatch",
    "tls key encrypted",
    "tls key without cert",
    "spool under a file",
    "spool is a directory",
    "listen port out of range",
    "listen host unknown",
    "relabel regex",
]


@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_run_and_check_config_refuse_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    overrides, expected = _edge_cases(tmp_path)[case]
    config = edge_config(tmp_path, **overrides)
    run_err, check_err = both("edge-relay", config, capsys)
    assert run_err == check_err
    assert "edge-relay: configuration error:" in run_err and expected in run_err, run_err
    assert "Traceback" not in run_err


def test_edge_check_config_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = edge_config(tmp_path)
    assert edge_cli.main(["check-config", "--config", str(config)]) == 0
    assert "# OK" in capsys.readouterr().out
    assert not (tmp_path / "spool").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relay.yaml"]


def test_edge_every_problem_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = edge_config(
        tmp_path,
        budget_file=budget(tmp_path, rate=-1),
        mqtt__tls={"ca_file": str(tmp_path / "nope.pem")},
        metrics={"listen": "127.0.0.1:70000"},
    )
    run_err, check_err = both("edge-relay", config, capsys)
    assert run_err == check_err
    for expected in ("sustained_bytes_per_second", "mqtt.tls.ca_file", "metrics.listen"):
        assert expected in check_err


def test_edge_good_tls_and_budget_pass_both(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pem = pem_files(tmp_path)
    tls = {"ca_file": str(pem["cert"]), "cert_file": str(pem["cert"]), "key_file": str(pem["key"])}
    config = edge_config(tmp_path, budget_file=budget(tmp_path), mqtt__tls=tls)
    assert edge_cli.main(["check-config", "--config", str(config)]) == 0
    with pytest.raises(Started):
        edge_cli.main(["run", "--config", str(config)])


def test_edge_config_only_skips_the_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = edge_config(tmp_path, mqtt__tls={"ca_file": "/nonexistent/ca.pem"})
    assert edge_cli.main(["check-config", "--config", str(config)]) == 2
    assert edge_cli.main(["check-config", "--config", str(config), "--config-only"]) == 0
    assert "machine checks skipped" in capsys.readouterr().out
    # ... but never the budget file, which ships with the config
    config = edge_config(tmp_path, budget_file=budget(tmp_path, resolution="5s"))
    assert edge_cli.main(["check-config", "--config", str(config), "--config-only"]) == 2


def test_edge_run_calls_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def validate(s: Any, **kwargs: Any) -> None:
        seen.append(s.source)
        raise Started

    monkeypatch.setattr(edge_checkconfig, "validate", validate)
    config = edge_config(tmp_path)
    with pytest.raises(Started):
        edge_cli.main(["run", "--config", str(config)])
    assert seen == [str(config)]


def test_edge_run_subprocess_says_what_check_config_says(tmp_path: Path) -> None:
    """The reported case, through the real processes: a budget file `run` refuses."""
    config = edge_config(tmp_path, budget_file=budget(tmp_path, rate=-5, resolution="5s"))

    def cli(command: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "edge_relay.cli", command, "--config", str(config)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    run, check = cli("run"), cli("check-config")
    assert run.returncode == check.returncode == 2
    assert run.stderr == check.stderr
    assert "resolution_seconds" in run.stderr and "sustained_bytes_per_second" in run.stderr
    assert not (tmp_path / "spool").exists()


# --- the cloud ingester ---------------------------------------------------------------------------------


def _cloud_cases(tmp_path: Path) -> dict[str, tuple[dict[str, Any], str]]:
    pem = pem_files(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return {
        "url without host": ({"remote_write__url": "http://"}, "remote_write.url"),
        "url bad port": ({"remote_write__url": "http://prom:99999/api/v1/write"}, "remote_write.url"),
        "header reserved": ({"remote_write__headers": {"Content-Type": "x"}}, "remote_write.headers"),
        "tls ca missing": ({"mqtt__tls": {"ca_file": str(tmp_path / "nope.pem")}}, "mqtt.tls.ca_file"),
        "tls key mismatch": (
            {"mqtt__tls": {"cert_file": str(pem["cert"]), "key_file": str(pem["other_key"])}},
            "cannot load client certificate",
        ),
        "dead letter under a file": ({"dead_letter__path": str(a_file / "dl.db")}, "dead_letter.path"),
        "listen port out of range": ({"metrics__listen": "0.0.0.0:65536"}, "out of range"),
    }


CLOUD_CASES = [
    "url without host",
    "url bad port",
    "header reserved",
    "tls ca missing",
    "tls key mismatch",
    "dead letter under a file",
    "listen port out of range",
]


@pytest.mark.parametrize("case", CLOUD_CASES)
def test_cloud_run_and_check_config_refuse_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    overrides, expected = _cloud_cases(tmp_path)[case]
    config = cloud_config(tmp_path, **overrides)
    run_err, check_err = both("cloud-ingest", config, capsys)
    assert run_err == check_err
    assert "cloud-ingest: configuration error:" in run_err and expected in run_err, run_err
    assert "Traceback" not in run_err


def test_cloud_good_config_passes_both_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pem = pem_files(tmp_path)
    tls = {"ca_file": str(pem["cert"]), "cert_file": str(pem["cert"]), "key_file": str(pem["key"])}
    config = cloud_config(tmp_path, mqtt__tls=tls)
    assert cloud_cli.main(["check-config", "--config", str(config)]) == 0
    assert not (tmp_path / "dl").exists()
    with pytest.raises(Started):
        cloud_cli.main(["run", "--config", str(config)])


def test_cloud_run_calls_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloud_ingest.commands import checkconfig as cloud_checkconfig

    def validate(s: Any, **kwargs: Any) -> None:
        raise Started

    monkeypatch.setattr(cloud_checkconfig, "validate", validate)
    with pytest.raises(Started):
        cloud_cli.main(["run", "--config", str(cloud_config(tmp_path))])
