"""A receiver behind TLS and authentication: ``remote_write.basic_auth``, ``authorization``,
``bearer_token_file``, ``tls_config`` and ``proxy_url``, as Prometheus' ``remote_write`` names them.

Against a real Prometheus serving HTTPS with a CA the test makes, wanting a client certificate and basic
auth (``--web.config.file``): with the right credentials the samples arrive; with wrong ones every write
is refused, retried and counted as a configuration error, and nothing is acked (the edge keeps the
batch); a rotated password file is used at the next request, without a restart. `run` and
`check-config` refuse unusable files naming the file and the key (`--config-only`, off the ingester's
machine, does not look at them).
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_write import block, labels

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.commands import checkconfig
from cloud_ingest.sinks.remote_write.connection import Connection, Credentials, connection_from
from relay_common.config import ConfigError
from schemas.model import Batch
from testkit.pki import Pki, make_pki
from testkit.rw_mock import MockReceiver, Reply

# Fixture, asked for by its pytest name: receiver.
from testkit.rw_mock import receiver_fixture as receiver_fixture
from testkit.services import Prometheus, ServiceFactory


def write_config(tmp_path: Path, remote_write: dict[str, Any]) -> Path:
    path = tmp_path / "ingest.yaml"
    config = {
        "mqtt": {"client_id": "ingest-auth-test"},
        "remote_write": {"max_retry_seconds": 1, "retry_min_seconds": 0.05, "retry_max_seconds": 0.2}
        | remote_write,
        "dead_letter": {"path": str(tmp_path / "dead.db")},
        "metrics": {"listen": ""},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def batch_now(seq: int, name: str = "rw_auth_test") -> Batch:
    now_ms = int(time.time()) * 1000 - 60_000
    sets = [labels(name, node="n1", idx=str(i)) for i in range(3)]
    return Batch(
        "c1",
        "n1",
        seq,
        sets,
        [block(now_ms + 15_000 * k, [(i, float(i + k)) for i in range(3)]) for k in range(2)],
    )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki", ["ingester"])


@pytest.fixture
def guarded(make_service: ServiceFactory, pki: Pki) -> Prometheus:
    """Prometheus behind TLS (certificate for 127.0.0.1), client certificates and basic auth (its web
    config takes bcrypt hashes: the test extra installs bcrypt, and a missing one fails the test)."""
    return make_service(
        Prometheus,
        tls=(pki.cert("broker"), pki.key("broker")),
        users={"ingest": "right-password"},
        client_ca=pki.ca,
        client_cert=(pki.cert("ingester"), pki.key("ingester")),
    )


def target(guarded: Prometheus, pki: Pki, password_file: Path) -> dict[str, Any]:
    return {
        "url": guarded.remote_write_url,
        "basic_auth": {"username": "ingest", "password_file": str(password_file)},
        "tls_config": {"ca_file": pki.ca, "cert_file": pki.cert("ingester"), "key_file": pki.key("ingester")},
    }


@contextlib.contextmanager
def ingesting(tmp_path: Path, remote_write: dict[str, Any]) -> Iterator[Ingester]:
    """An ingester (not started: its sink as the pipeline uses it) with this ``remote_write``."""
    ingester = Ingester(settings_mod.load(str(write_config(tmp_path, remote_write))))
    try:
        yield ingester
    finally:
        ingester.sink.close()
        ingester.dead_letters.close()


def stored(prom: Prometheus, name: str) -> int:
    return sum(len(v) for v in prom.raw_samples(name).values())


@pytest.mark.integration
def test_right_credentials_write_wrong_ones_are_kept_and_alerted_and_a_rotated_file_is_used(
    tmp_path: Path, guarded: Prometheus, pki: Pki
) -> None:
    password = tmp_path / "password"
    password.write_text("wrong-password\n")
    with ingesting(tmp_path, target(guarded, pki, password)) as ingester:
        refused = ingester.sink.write(batch_now(1))
        assert refused.status == "retry_later" and "HTTP 401" in refused.retry_reason
        assert ingester.metrics.config_errors.labels("401")._value.get() >= 2  # retried, alerted
        assert stored(guarded, "rw_auth_test") == 0

        password.write_text("right-password\n")  # rotated: no restart
        result = ingester.sink.write(batch_now(1))
        assert (result.status, result.written) == ("done", 6)
        assert stored(guarded, "rw_auth_test") == 6


@pytest.mark.integration
@pytest.mark.parametrize("wrong", ["a CA that did not sign the receiver", "no client certificate"])
def test_a_tls_setup_the_receiver_refuses_writes_nothing_and_is_a_configuration_error(
    tmp_path: Path, guarded: Prometheus, pki: Pki, wrong: str
) -> None:
    password = tmp_path / "password"
    password.write_text("right-password")
    rw = target(guarded, pki, password)
    if wrong == "no client certificate":
        del rw["tls_config"]["cert_file"], rw["tls_config"]["key_file"]
    else:
        rw["tls_config"]["ca_file"] = make_pki(tmp_path / "other", []).ca
    with ingesting(tmp_path, rw) as ingester:
        result = ingester.sink.write(batch_now(2, "rw_auth_tls"))
        assert result.status == "retry_later", wrong
        if wrong != "no client certificate":  # refused in the handshake, by us
            assert "TLS" in result.retry_reason
            assert ingester.metrics.config_errors.labels("0")._value.get() >= 1
        assert stored(guarded, "rw_auth_tls") == 0


# -- credentials on the wire (a mock receiver) ---------------------------------------------------------


def test_bearer_token_file_and_authorization_go_as_the_header_read_again_when_rotated(
    tmp_path: Path, receiver: MockReceiver
) -> None:
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    for rw in (
        {"bearer_token_file": str(token)},
        {"authorization": {"credentials_file": str(token)}},
        {"authorization": {"type": "Token", "credentials": "inline"}},
        {"basic_auth": {"username": "u", "password": "p"}},
    ):
        receiver.script.extend([Reply(204), Reply(204)])
        with ingesting(tmp_path, {"url": receiver.url} | rw) as ingester:
            token.write_text("tok-1\n")
            assert ingester.sink.write(batch_now(1)).status == "done"
            token.write_text("tok-2-longer\n")
            assert ingester.sink.write(batch_now(2)).status == "done"
    sent = [r.headers["Authorization"] for r in receiver.received]
    basic = "Basic " + base64.b64encode(b"u:p").decode()
    assert sent == [
        *("Bearer tok-1", "Bearer tok-2-longer") * 2,
        "Token inline",
        "Token inline",
        basic,
        basic,
    ]


def test_a_credentials_file_gone_at_run_time_is_retried_as_a_configuration_error(
    tmp_path: Path, receiver: MockReceiver
) -> None:
    token = tmp_path / "token"
    token.write_text("tok")
    with ingesting(tmp_path, {"url": receiver.url, "bearer_token_file": str(token)}) as ingester:
        token.unlink()
        result = ingester.sink.write(batch_now(1))
        assert result.status == "retry_later"
        assert str(token) in result.retry_reason
        assert "remote_write.authorization.credentials_file" in result.retry_reason
        assert ingester.metrics.config_errors.labels("0")._value.get() >= 1
        assert receiver.received == []


def test_proxy_url_sends_the_requests_through_the_proxy(tmp_path: Path, receiver: MockReceiver) -> None:
    # The mock receiver stands in for the proxy: a proxied plain-HTTP request carries the absolute URL.
    receiver.script.append(Reply(204))
    rw = {"url": "http://receiver.invalid:9/api/v1/write", "proxy_url": receiver.url.rsplit("/api", 1)[0]}
    with ingesting(tmp_path, rw) as ingester:
        assert ingester.sink.write(batch_now(1)).status == "done"
    assert len(receiver.received) == 1


# -- the config loader names the file and the key ------------------------------------------------------


@pytest.mark.parametrize(
    ("rw", "says", "names_file"),
    [
        ({"basic_auth": {"username": "u", "password_file": "missing"}}, "basic_auth.password_file", True),
        ({"bearer_token_file": "missing"}, "remote_write.authorization.credentials_file", True),
        ({"authorization": {"credentials_file": "missing"}}, "authorization.credentials_file", True),
        ({"tls_config": {"ca_file": "missing"}}, "remote_write.tls_config.ca_file", True),
        ({"tls_config": {"ca_file": "notpem"}}, "remote_write.tls_config.ca_file", True),
        ({"tls_config": {"cert_file": "notpem"}}, "remote_write.tls_config.cert_file", True),
        ({"tls_config": {"key_file": "notpem"}}, "remote_write.tls_config.key_file", False),
        (
            {"basic_auth": {"username": "u", "password": "p"}, "bearer_token_file": "notpem"},
            "set at most one of basic_auth, bearer_token_file",
            False,
        ),
        (
            {"basic_auth": {"username": "u", "password": "p", "password_file": "notpem"}},
            "remote_write.basic_auth",
            False,
        ),
        (
            {"authorization": {"credentials": "x"}, "headers": {"Authorization": "Bearer y"}},
            "remote_write.headers.Authorization",
            False,
        ),
        ({"authorization": {"credentials": "line\nbreak"}}, "cannot go in an HTTP header", False),
    ],
)
def test_unusable_credentials_are_refused_at_load_naming_the_key(
    tmp_path: Path, rw: dict[str, Any], says: str, names_file: bool
) -> None:
    (tmp_path / "notpem").write_text("just text")
    rw = yaml.safe_load(
        yaml.safe_dump(rw)
        .replace("missing", str(tmp_path / "missing"))
        .replace("notpem", str(tmp_path / "notpem"))
    )
    with pytest.raises(ConfigError) as e:  # as `run` and `check-config` refuse it, before anything starts
        checkconfig.validate(
            settings_mod.load(str(write_config(tmp_path, {"url": "https://127.0.0.1:9/api/v1/write"} | rw)))
        )
    assert says in str(e.value)
    if names_file:
        assert str(tmp_path) in str(e.value)


def test_connection_from_reads_prometheus_names() -> None:
    conn = connection_from({"bearer_token_file": "/t", "proxy_url": "http://p:3128"}, "remote_write")
    assert conn.authorization is not None and conn.authorization.credentials_file == "/t"
    assert conn.proxy_url == "http://p:3128"
    assert Credentials(Connection()).header() is None


def test_config_only_does_not_look_at_the_files(tmp_path: Path) -> None:
    rw = {"url": "https://r:9/api/v1/write", "bearer_token_file": str(tmp_path / "on-the-ingester-only")}
    checkconfig.validate(settings_mod.load(str(write_config(tmp_path, rw))), host=False)


@pytest.mark.integration
def test_a_renewed_client_certificate_is_used_by_the_next_connection(
    tmp_path: Path, guarded: Prometheus, pki: Pki
) -> None:
    password = tmp_path / "password"
    password.write_text("right-password")
    stale = make_pki(tmp_path / "stale", ["ingester"])  # a certificate the receiver's CA did not sign
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    cert.write_bytes(Path(stale.cert("ingester")).read_bytes())
    key.write_bytes(Path(stale.key("ingester")).read_bytes())
    rw = target(guarded, pki, password)
    rw["tls_config"] |= {"cert_file": str(cert), "key_file": str(key)}
    with ingesting(tmp_path, rw) as ingester:
        assert ingester.sink.write(batch_now(1, "rw_auth_renewed")).status == "retry_later"

        # Renewed in place, as cert-manager does with a mounted Secret: key first, then certificate.
        key.write_bytes(Path(pki.key("ingester")).read_bytes())
        cert.write_bytes(Path(pki.cert("ingester")).read_bytes())
        result = ingester.sink.write(batch_now(1, "rw_auth_renewed"))
        assert (result.status, result.written) == ("done", 6)
        assert stored(guarded, "rw_auth_renewed") == 6
