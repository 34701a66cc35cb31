"""Loopback ports for tests that must name a port before the process that listens on it starts.

Owns: picking such a port so that nothing else on the machine takes it in the meantime.
Must not know: which service listens on it.

A port from ``bind(("127.0.0.1", 0))`` lies in the kernel's ephemeral range, which is also where
every outgoing connection's local port comes from; a test that starts its services one after
another (compose's depends_on order) holds such a number for seconds while other tests' clients
connect, and one of them can take it (CI saw "address already in use"). Ports below that range
are never handed out implicitly, so a free one stays free unless another test picks the same
number: the choice is random over thousands of ports and checked by binding.
"""
from __future__ import annotations

import random
import socket

LOW = 10_000                    # below this, well-known services and other fixed assignments


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768           # Linux's default when the file cannot be read


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port on ``host`` that binds now and lies below the ephemeral range."""
    high = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(LOW, high) if high > LOW + 100 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port on {host} below {high} after {attempts} tries")
