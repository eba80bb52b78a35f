"""``remote_write.headers``: extra HTTP headers (multi-tenant receivers) from the config file to the wire.

Mimir wants the tenant in ``X-Scope-OrgID``, Thanos Receive in ``THANOS-TENANT``, a gateway may want
``Authorization``. The headers are configured once and must go with *every* request, retries included;
the headers the remote-write client sets itself (the protocol's) cannot be overridden, and a header the
HTTP stack could not send is a configuration error at load time (``cloud-ingest check-config`` says so),
not an exception in a worker thread on the first batch. Requests go to the scripted ``MockReceiver`` of
``testkit/rw_mock.py`` on 127.0.0.1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_write import (
    DEFAULT_USER_AGENT,
    actual_series,
    expected_series,
    make_client,
    special_batch,
    unsnappy,
)

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.sinks.remote_write.client import PROTOCOL_HEADERS, RemoteWriteClient, check_headers
from relay_common.config import ConfigError
from testkit.rw_mock import FakeTime, MockReceiver, Reply

# Fixtures, asked for by their pytest names: receiver, fake_time.
from testkit.rw_mock import fake_time_fixture as fake_time_fixture
from testkit.rw_mock import receiver_fixture as receiver_fixture

ROOT = Path(__file__).resolve().parents[2]

TENANT_HEADERS = {
    "mimir": {"X-Scope-OrgID": "fleet-north"},
    "thanos": {"THANOS-TENANT": "fleet-north"},
    "gateway": {"Authorization": "Bearer abc.def-123", "X-Scope-OrgID": "a|b"},
}


def write_config(tmp_path: Path, headers: Any, url: str = "http://127.0.0.1:9/api/v1/write") -> Path:
    path = tmp_path / "ingest.yaml"
    config = {
        "mqtt": {"client_id": "ingest-headers-test"},
        "remote_write": {"url": url, "headers": headers},
        "dead_letter": {"path": str(tmp_path / "dead.db")},
        "metrics": {"listen": ""},
    }
    path.write_text(yaml.safe_dump(config))
    return path


# -- from the config file to every request -----------------------------------------------------------


@pytest.mark.parametrize("kind", list(TENANT_HEADERS))
def test_configured_headers_go_with_every_request_retries_included(
    kind: str, tmp_path: Path, receiver: MockReceiver, fake_time: FakeTime
) -> None:
    headers = TENANT_HEADERS[kind]
    s = settings_mod.load(str(write_config(tmp_path, headers, receiver.url)))
    assert s.remote_write_headers == headers
    receiver.script.extend([Reply(503, b"ingesters unavailable"), Reply(429, b"slow down"), Reply(204)])
    client = make_client(receiver.url, fake_time, headers=s.remote_write_headers)
    batch = special_batch()

    outcome = client.write(batch)

    assert outcome.status == "written" and outcome.attempts == 3
    assert len(receiver.received) == 3
    for got in receiver.received:
        for name, value in headers.items():
            assert got.headers[name] == value, f"{name} missing or changed on a request"
        # The protocol's own headers are untouched by the extra ones.
        assert got.headers["Content-Encoding"] == "snappy"
        assert got.headers["Content-Type"] == "application/x-protobuf"
        assert got.headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
        assert got.headers["User-Agent"] == DEFAULT_USER_AGENT
        assert actual_series(unsnappy(got.body)) == expected_series(batch)


def test_default_is_no_extra_header(tmp_path: Path, receiver: MockReceiver, fake_time: FakeTime) -> None:
    path = tmp_path / "ingest.yaml"
    path.write_text(yaml.safe_dump({"remote_write": {"url": receiver.url}}))
    s = settings_mod.load(str(path))
    assert s.remote_write_headers == {}
    client = make_client(receiver.url, fake_time, headers=s.remote_write_headers)
    assert client.write(special_batch()).status == "written"
    [got] = receiver.received
    sent = {name.lower() for name in got.headers}
    # What requests/urllib3 add by themselves, plus the protocol's four and the length.
    stack = {"host", "accept", "accept-encoding", "connection"}
    assert sent - stack == {h.lower() for h in PROTOCOL_HEADERS}


def test_the_ingester_hands_the_configured_headers_to_its_writer(tmp_path: Path) -> None:
    headers = {"X-Scope-OrgID": "tenant-7", "Authorization": "Basic dXNlcjpwYXNz"}
    s = settings_mod.load(str(write_config(tmp_path, headers)))
    ingester = Ingester(s)  # not started: no broker connection, only the wiring
    try:
        sent = ingester.writer.headers
        assert {k: sent[k] for k in headers} == headers
        assert sent["Content-Type"] == "application/x-protobuf"
    finally:
        ingester.dead_letters.close()
        ingester.writer.close()


def test_env_url_override_keeps_the_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, receiver: MockReceiver, fake_time: FakeTime
) -> None:
    """The URL may come from CLOUD_INGEST_REMOTE_WRITE_URL; the tenant header still comes along."""
    monkeypatch.setenv("CLOUD_INGEST_REMOTE_WRITE_URL", receiver.url)
    s = settings_mod.load(str(write_config(tmp_path, {"X-Scope-OrgID": "t1"})))
    assert s.remote_write_url == receiver.url
    client = make_client(s.remote_write_url, fake_time, headers=s.remote_write_headers)
    assert client.write(special_batch()).status == "written"
    assert receiver.received[0].headers["X-Scope-OrgID"] == "t1"


# -- refused at load time ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        *PROTOCOL_HEADERS,
        "content-type",
        "CONTENT-ENCODING",
        "x-prometheus-remote-write-version",
        "user-agent",
        "content-length",
    ],
)
def test_protocol_headers_are_a_config_error(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        settings_mod.load(str(write_config(tmp_path, {"X-Scope-OrgID": "ok", name: "x"})))
    text = str(err.value)
    assert f"key `remote_write.headers.{name}`" in text
    assert "set by the remote-write client itself" in text
    assert str(tmp_path / "ingest.yaml") in text


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({"X Scope": "t"}, "not a valid HTTP header name"),
        ({"X-Scope:OrgID": "t"}, "not a valid HTTP header name"),
        ({"": "t"}, "not a valid HTTP header name"),
        ({"X-Tenänt": "t"}, "not a valid HTTP header name"),
        ({"X-Evil": "a\r\nInjected: 1"}, "printable ASCII"),
        ({"X-Evil": "a\nb"}, "printable ASCII"),
        ({"X-Tab": "a\tb"}, "printable ASCII"),
        ({"X-Nul": "a\x00"}, "printable ASCII"),
        ({"X-Tenant": "ümlaut"}, "printable ASCII"),
        ({"X-Tenant": " leading"}, "leading/trailing blanks"),
        ({"X-Tenant": "trailing "}, "leading/trailing blanks"),
    ],
)
def test_unsendable_headers_are_a_config_error(headers: dict[str, str], why: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"remote_write\.headers") as err:
        settings_mod.load(str(write_config(tmp_path, headers)))
    assert why in str(err.value)
    # The client refuses the same headers when built directly.
    with pytest.raises(ValueError, match="header"):
        RemoteWriteClient("http://127.0.0.1:1/api/v1/write", headers=headers)


def test_the_same_header_twice_in_two_spellings_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        settings_mod.load(str(write_config(tmp_path, {"X-Scope-OrgID": "a", "x-scope-orgid": "b"})))


def test_non_string_values_are_refused_by_the_schema(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"remote_write\.headers\.X-Scope-OrgID"):
        settings_mod.load(str(write_config(tmp_path, {"X-Scope-OrgID": 42})))


def test_empty_value_is_allowed() -> None:
    check_headers({"X-Empty": ""})


def test_check_config_reports_a_reserved_header(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"User-Agent": "mine/1"})
    result = subprocess.run(
        [sys.executable, "-m", "cloud_ingest.cli", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "configuration error" in result.stderr
    assert "remote_write.headers.User-Agent" in result.stderr
    assert "Traceback" not in result.stderr
