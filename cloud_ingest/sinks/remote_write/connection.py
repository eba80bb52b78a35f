"""How the remote-write client reaches one receiver: credentials, TLS and a proxy, named as Prometheus'
``remote_write`` names them (``basic_auth``, ``authorization``, ``bearer_token_file``, ``tls_config``,
``proxy_url``).

Secrets and certificates are read from files so that a rotated token or certificate is used without a
restart: a credentials file is looked at (``stat``) before every request and read again when it changed;
the TLS files are looked at before every request too, and when one changed the connection pool is
rebuilt, so the next connection uses them (a connection that is open keeps the handshake it made). A
file that cannot be read at run time is a configuration error like a 401: the write is retried, the edge
keeps the batch, the error names the file and its config key.
"""

from __future__ import annotations

import base64
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import requests
import requests.adapters
import requests.utils

from relay_common.config import ConfigError

# Enough pooled keep-alive connections for several writer threads sharing one client.
POOL_MAXSIZE = 32


class CredentialsError(Exception):
    """A credentials or TLS file that cannot be used now; the message names the file and its key."""


@dataclass(frozen=True, slots=True)
class BasicAuth:
    username: str
    password: str | None = None
    password_file: str | None = None


@dataclass(frozen=True, slots=True)
class Authorization:
    type: str = "Bearer"
    credentials: str | None = None
    credentials_file: str | None = None


@dataclass(frozen=True, slots=True)
class TlsConfig:
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None
    insecure_skip_verify: bool = False


@dataclass(frozen=True, slots=True)
class Connection:
    """One target's way in. ``key`` is its config key (``remote_write``), for the messages."""

    basic_auth: BasicAuth | None = None
    authorization: Authorization | None = None
    tls: TlsConfig | None = None
    proxy_url: str | None = None
    key: str = "remote_write"


def connection_from(raw: Mapping[str, Any], key: str = "remote_write") -> Connection:
    """From a validated target section; ``bearer_token_file`` is read as an ``authorization`` of type
    Bearer (as Prometheus does)."""
    basic = raw.get("basic_auth")
    auth = raw.get("authorization")
    if auth is None and raw.get("bearer_token_file"):
        auth = {"type": "Bearer", "credentials_file": raw["bearer_token_file"]}
    tls = raw.get("tls_config")
    return Connection(
        basic_auth=BasicAuth(basic["username"], basic.get("password"), basic.get("password_file"))
        if basic
        else None,
        authorization=Authorization(
            auth.get("type", "Bearer"), auth.get("credentials"), auth.get("credentials_file")
        )
        if auth
        else None,
        tls=TlsConfig(
            tls.get("ca_file"),
            tls.get("cert_file"),
            tls.get("key_file"),
            tls.get("server_name"),
            bool(tls.get("insecure_skip_verify", False)),
        )
        if tls
        else None,
        proxy_url=raw.get("proxy_url") or None,
        key=key,
    )


def check_connection(raw: Mapping[str, Any], conn: Connection, source: str) -> None:
    """ConfigError unless ``conn`` makes sense, files aside (``check_connection_files``): one kind of
    credentials, each given once, inline ones that fit in a header. ``raw`` is the validated section."""
    key = conn.key
    kinds = [k for k in ("basic_auth", "authorization", "bearer_token_file") if raw.get(k)]
    if len(kinds) > 1:
        raise ConfigError(f"{source}: key `{key}`: set at most one of {', '.join(kinds)}")
    if kinds and any(name.lower() == "authorization" for name in raw.get("headers", {})):
        raise ConfigError(
            f"{source}: key `{key}.headers.Authorization`: the credentials are already set by "
            f"`{key}.{kinds[0]}`"
        )
    if conn.basic_auth and conn.basic_auth.password and conn.basic_auth.password_file:
        raise ConfigError(f"{source}: key `{key}.basic_auth`: set password or password_file, not both")
    if conn.authorization and conn.authorization.credentials and conn.authorization.credentials_file:
        raise ConfigError(
            f"{source}: key `{key}.authorization`: set credentials or credentials_file, not both"
        )
    inline = Connection(
        basic_auth=conn.basic_auth if conn.basic_auth and not conn.basic_auth.password_file else None,
        authorization=conn.authorization
        if conn.authorization and not conn.authorization.credentials_file
        else None,
    )
    header = Credentials(inline).header()
    try:
        if header is not None:
            requests.utils.check_header_validity(("Authorization", header))
    except requests.exceptions.InvalidHeader as e:
        raise ConfigError(f"{source}: key `{key}`: the credentials cannot go in an HTTP header: {e}") from e


def check_connection_files(conn: Connection, source: str) -> None:
    """ConfigError unless the credentials file can be read and the TLS files loaded, naming the file
    and its key (what depends on the machine the ingester runs on)."""
    try:
        Credentials(conn).header()
        if conn.tls is not None:
            tls_context(conn.tls, conn.key)
    except CredentialsError as e:
        raise ConfigError(f"{source}: {e}") from e


class SecretFile:
    """A file's content (blanks around it stripped, as Prometheus does), read again when the file
    changed (its inode, size or modification time). Thread-safe."""

    def __init__(self, path: str, key: str) -> None:
        self.path = path
        self.key = key
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._value = ""

    def value(self) -> str:
        try:
            st = os.stat(self.path)
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                if seen != self._seen:
                    with open(self.path, encoding="utf-8") as f:
                        self._value = f.read().strip()
                    self._seen = seen
                return self._value
        except OSError as e:
            raise CredentialsError(f"key `{self.key}`: cannot read {self.path}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise CredentialsError(f"key `{self.key}`: {self.path} is not UTF-8 text") from e


class Credentials:
    """The ``Authorization`` header a target's requests carry, from its current files."""

    def __init__(self, conn: Connection) -> None:
        self._basic = conn.basic_auth
        self._authorization = conn.authorization
        self._file: SecretFile | None = None
        if self._basic and self._basic.password_file:
            self._file = SecretFile(self._basic.password_file, f"{conn.key}.basic_auth.password_file")
        if self._authorization and self._authorization.credentials_file:
            self._file = SecretFile(
                self._authorization.credentials_file, f"{conn.key}.authorization.credentials_file"
            )

    def header(self) -> str | None:
        """The header's value, None without credentials; CredentialsError when a file is unreadable."""
        if self._basic is not None:
            password = self._file.value() if self._file else self._basic.password or ""
            pair = f"{self._basic.username}:{password}".encode()
            return "Basic " + base64.b64encode(pair).decode("ascii")
        if self._authorization is not None:
            secret = self._file.value() if self._file else self._authorization.credentials or ""
            return f"{self._authorization.type} {secret}"
        return None


def _tls_files(tls: TlsConfig) -> tuple[tuple[str, int, int, int] | None, ...]:
    out = []
    for path in (tls.ca_file, tls.cert_file, tls.key_file):
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        out.append((path, st.st_ino, st.st_size, st.st_mtime_ns) if path and st else None)
    return tuple(out)


def tls_context(tls: TlsConfig, key: str) -> ssl.SSLContext:
    """A client context from the files as they are now; CredentialsError naming the key otherwise."""
    context = ssl.create_default_context()
    if tls.insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if tls.ca_file:
        try:
            context.load_verify_locations(cafile=tls.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise CredentialsError(
                f"key `{key}.tls_config.ca_file`: no usable CA certificate in {tls.ca_file}: "
                f"{getattr(e, 'strerror', None) or e}"
            ) from e
    if tls.key_file and not tls.cert_file:
        raise CredentialsError(f"key `{key}.tls_config.key_file`: set without `{key}.tls_config.cert_file`")
    if tls.cert_file:
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
        except (OSError, ssl.SSLError) as e:
            raise CredentialsError(
                f"key `{key}.tls_config.cert_file`: cannot load the client certificate {tls.cert_file}"
                f"{' with key ' + tls.key_file if tls.key_file else ''}: {getattr(e, 'strerror', None) or e}"
            ) from e
    return context


class TlsAdapter(requests.adapters.HTTPAdapter):
    """HTTPS with a target's ``tls_config``: its CA, client certificate and server name; when one of
    its files changed, the pools are rebuilt before the next request so new connections use them."""

    def __init__(self, tls: TlsConfig, key: str) -> None:
        self._tls = tls
        self._key = key
        self._lock = threading.Lock()
        self._files = _tls_files(tls)
        self._context = tls_context(tls, key)
        super().__init__(pool_connections=4, pool_maxsize=POOL_MAXSIZE)

    def _tls_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"ssl_context": self._context}
        if self._tls.server_name:
            kw["server_hostname"] = self._tls.server_name
            kw["assert_hostname"] = False if self._tls.insecure_skip_verify else self._tls.server_name
        elif self._tls.insecure_skip_verify:
            kw["assert_hostname"] = False
        return kw

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **kw: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **kw, **self._tls_kwargs())

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        return super().proxy_manager_for(proxy, **proxy_kwargs, **self._tls_kwargs())

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        files = _tls_files(self._tls)
        if files != self._files:
            with self._lock:
                if files != self._files:
                    context = tls_context(self._tls, self._key)  # CredentialsError: keep the old pools
                    self._context, self._files = context, files
                    self.poolmanager.clear()
                    for manager in self.proxy_manager.values():
                        manager.clear()
                    self.proxy_manager.clear()
                    self.init_poolmanager(self._pool_connections, self._pool_maxsize, self._pool_block)
        # requests' own verify/cert handling would replace the context's settings: the context decides.
        kwargs["verify"] = not self._tls.insecure_skip_verify
        kwargs["cert"] = None
        return super().send(request, *args, **kwargs)

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        # The CA and the client certificate are in the context already.
        return None


def session_for(conn: Connection | None) -> requests.Session:
    """A session for one target: its TLS adapter for https, its proxy (else the environment's, as
    requests reads it: HTTPS_PROXY, NO_PROXY ...)."""
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=POOL_MAXSIZE))
    if conn is not None and conn.tls is not None:
        session.mount("https://", TlsAdapter(conn.tls, conn.key))
    else:
        session.mount(
            "https://", requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=POOL_MAXSIZE)
        )
    if conn is not None and conn.proxy_url:
        session.proxies = {"http": conn.proxy_url, "https": conn.proxy_url}
    return session
