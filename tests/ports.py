"""Ports for the servers, routers and rendezvous the tests start.

A port from `bind(("127.0.0.1", 0))` lies in the kernel's ephemeral range, where every outgoing
connection (a test's client, the router's to its workers, gloo's store) also takes its source
port. Between the check and the server's own bind, one of them can take it: CI saw
sglang-router fail with "Address already in use" that way. So ports here come from below that
range, and none is handed out twice in a test session.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_LOWEST = 20000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, outside the ephemeral range, not handed out before in this process."""
    high = _ephemeral_low()
    span = high - _LOWEST
    if span < 1000:  # an unusual range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    start = os.getpid() * 7919 % span  # two test processes on one machine start apart
    for i in range(span):
        port = _LOWEST + (start + i) % span
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in [{_LOWEST}, {high})")
