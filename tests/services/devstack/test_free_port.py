"""`free_port` hands out ports an outgoing connection cannot take before the service binds them."""

from __future__ import annotations

import socket

from services.devstack.embedded import _ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > 21000:  # Linux's default range starts at 32768
        assert all(port < low for port in ports)
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
