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


def test_an_outgoing_connection_never_lands_on_a_handed_out_port() -> None:
    """The race this closes: the kernel gives outgoing connections local ports from the ephemeral range."""
    low, high = _ephemeral_range()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            local = client.getsockname()[1]
    if low:
        assert low <= local <= high
        assert free_port() < low
