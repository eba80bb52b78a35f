"""The uplink's network loop: one paho client driven through paho's external-loop API
(``loop_read`` / ``loop_write`` / ``loop_misc``) in a ``select()`` that another thread can wake.

Why not ``Client.loop(timeout)``: its ``select()`` wakes only for the broker's socket and for paho's
own publications, so a new spool row written by the relay thread waited for the timeout: up to
0.25 s idle, which is why the uplink turned 20 times a second while a batch was in flight and 4 times
when idle. A turn costs 0.05-0.1 ms of CPU (paho 2.2 on loopback, in a process doing nothing else:
1.0 ms a second at 20 turns, 0.37 at 4, 0.13 at 1). With a wake socket the loop sleeps until the
broker sends something, a thread calls ``wake()``, or the caller's next deadline, and a new row is
published at once instead of up to a turn later.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

import paho.mqtt.client as mqtt


class WakeableLoop:
    """``turn(client, timeout)`` blocks until the broker's socket has something, ``wake()`` is
    called (any thread), or ``timeout`` seconds pass; then it does the client's reads, writes and
    housekeeping, like ``Client.loop``. ``woken`` tells whether a ``wake()`` came since the last
    ``clear()``; a turn ends early once per ``wake()`` (a caller that has not acted on ``woken`` yet
    passes a timeout of 0 itself)."""

    def __init__(self) -> None:
        self._read_end, self._write_end = socket.socketpair()
        self._read_end.setblocking(False)
        self._write_end.setblocking(False)
        self._woken = threading.Event()
        self._closed = False

    def wake(self) -> None:
        self._woken.set()
        # One byte is enough to end a select(); a full buffer means a wake is pending already.
        with contextlib.suppress(BlockingIOError, OSError):
            self._write_end.send(b"\0")

    @property
    def woken(self) -> bool:
        return self._woken.is_set()

    def clear(self) -> None:
        self._woken.clear()

    def turn(self, client: mqtt.Client, timeout: float) -> mqtt.MQTTErrorCode:
        sock = client.socket()
        if sock is None:
            return mqtt.MQTT_ERR_NO_CONN
        # Bytes TLS has decrypted already are invisible to select(): read them without waiting.
        pending = sock.pending() if hasattr(sock, "pending") else 0
        if pending > 0:
            timeout = 0.0
        wlist = [sock] if client.want_write() else []
        try:
            readable, writable, _ = select.select([sock, self._read_end], wlist, [], max(timeout, 0.0))
        except (TypeError, ValueError, OSError):
            # The client closed its socket (a lost connection, a disconnect) under us.
            return mqtt.MQTT_ERR_CONN_LOST
        if self._read_end in readable:
            with contextlib.suppress(BlockingIOError, OSError):
                self._read_end.recv(4096)
        if sock in readable or pending > 0:
            rc = client.loop_read()
            if rc != mqtt.MQTT_ERR_SUCCESS or client.socket() is None:
                return rc
        # Publications queued inside a callback were not written then: write whatever waits.
        if sock in writable or client.want_write():
            rc = client.loop_write()
            if rc != mqtt.MQTT_ERR_SUCCESS or client.socket() is None:
                return rc
        return client.loop_misc()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._read_end.close()
            self._write_end.close()
