"""Start-up checks of what a config names on this machine, shared by ``run`` and ``check-config``.

Both programs' ``checkconfig.validate`` runs these before ``run`` builds anything, and ``check-config``
runs the same function, so the two always say the same thing about a config. A check never creates
anything (``check-config`` may run beside a live process or on a machine that is not the node); each
raises ``ConfigError`` naming the file, the key and the problem, like the loader's own errors.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from relay_common.config import ConfigError
from relay_common.httpserver import split_host_port


def collect(checks: list[Callable[[], object]]) -> None:
    """Run every check, then raise one ConfigError with every problem found (one a line), if any."""
    problems: list[str] = []
    for check in checks:
        try:
            check()
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))


def check_writable_dir(file_path: str, key: str, source: str) -> None:
    """The program will create (or open) the SQLite file ``file_path`` and its -wal/-shm beside it:
    the file, if there, must be a writable file, and its directory writable, or creatable (``run``
    creates missing directories) from its nearest existing ancestor."""
    path = Path(file_path)
    where = f"{source}: key `{key}`"
    if path.exists():
        if not path.is_file():
            raise ConfigError(f"{where}: {path} exists and is not a file")
        if not os.access(path, os.R_OK | os.W_OK):
            raise ConfigError(
                f"{where}: {path} is not readable and writable by this user (uid {os.getuid()})"
            )
    directory = path.parent
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{where}: cannot create {directory}: {existing} is not a directory")
    # A real file, not os.access: root is "allowed" everything, yet a read-only mount refuses it.
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        target = "" if existing == directory else f" (to create {directory})"
        raise ConfigError(f"{where}: cannot write in {existing}{target}: {e.strerror or e}") from e


def check_listen(listen: str, key: str, source: str) -> None:
    """A ``host:port`` the metrics server can bind: a port number and a host that resolves to an IPv4
    address (``ThreadingHTTPServer`` is AF_INET). Whether the port is free is not checked: the
    process this config is for may be running."""
    if not listen:
        return
    where = f"{source}: key `{key}`"
    try:
        host, port = split_host_port(listen)
    except ValueError:
        raise ConfigError(f"{where}: expected host:port, got {listen!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} is out of range (0-65535)")
    try:
        socket.getaddrinfo(
            host, port, family=socket.AF_INET, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(
            f"{where}: cannot listen on {host!r} (IPv4 only): {getattr(e, 'strerror', e)}"
        ) from e
