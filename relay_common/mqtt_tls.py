"""MQTT TLS settings, shared by the relay and the ingester."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt

from relay_common.config import ConfigError


@dataclass(frozen=True, slots=True)
class TLS:
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    insecure_skip_verify: bool


def tls_from(raw: dict[str, Any] | None) -> TLS | None:
    """From the validated `mqtt.tls` config section (absent = plain TCP)."""
    if raw is None:
        return None
    return TLS(raw.get("ca_file"), raw.get("cert_file"), raw.get("key_file"), raw["insecure_skip_verify"])


class _Encrypted(Exception):
    pass


def _no_passphrase() -> bytes:
    # paho would let OpenSSL prompt for it on the terminal: a relay would hang at its first connect.
    raise _Encrypted


def check_tls(tls: TLS | None, source: str, key: str = "mqtt.tls") -> None:
    """Raise ConfigError unless the TLS files can be used: each exists, is readable and is PEM, and they
    load into an SSL context as ``tls_configure`` (paho's ``tls_set``) loads them: the CA bundle with
    ``load_verify_locations``, the certificate with its key with ``load_cert_chain``."""
    if tls is None:
        return
    for name, path in (("ca_file", tls.ca_file), ("cert_file", tls.cert_file), ("key_file", tls.key_file)):
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                head = f.read(1 << 20)
        except OSError as e:
            raise ConfigError(f"{source}: key `{key}.{name}`: cannot read {path}: {e.strerror or e}") from e
        if b"-----BEGIN " not in head:
            raise ConfigError(f"{source}: key `{key}.{name}`: {path} is not PEM (no -----BEGIN line)")
    if tls.key_file and not tls.cert_file:
        raise ConfigError(f"{source}: key `{key}.key_file`: set without `{key}.cert_file`")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.ca_file:
        try:
            context.load_verify_locations(cafile=tls.ca_file)
        except ssl.SSLError as e:
            raise ConfigError(
                f"{source}: key `{key}.ca_file`: no usable CA certificate in {tls.ca_file} ({e.reason or e})"
            ) from e
    if tls.cert_file:
        which = f"{tls.cert_file}" + (f" with key {tls.key_file}" if tls.key_file else "")
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_passphrase)
        except _Encrypted:
            raise ConfigError(
                f"{source}: key `{key}.key_file`: the private key is encrypted; give an unencrypted key"
            ) from None
        except ssl.SSLError as e:
            raise ConfigError(
                f"{source}: key `{key}.cert_file`: cannot load client certificate {which}: {e.reason or e}"
            ) from e


def tls_configure(client: mqtt.Client, tls: TLS | None) -> None:
    if tls is None:
        return
    client.tls_set(ca_certs=tls.ca_file, certfile=tls.cert_file, keyfile=tls.key_file)
    if tls.insecure_skip_verify:
        client.tls_insecure_set(True)
