"""The port helpers the tests, benchmarks and `kvmesh up` share: real sockets on this machine."""

from __future__ import annotations

import socket

from kvmesh.engine.util import localproc
from kvmesh.engine.util.localproc import free_port, free_port_run, free_ports


def test_ports_come_from_below_the_ephemeral_range_so_no_client_socket_can_take_them():
    low = localproc._ephemeral_low()
    for _ in range(50):
        assert localproc._LOWEST_PORT <= free_port() < low
        base = free_port_run(4)
        assert base + 3 < low


def test_a_run_is_consecutive_bindable_and_avoids_what_it_is_told():
    for _ in range(20):
        a, b = free_ports(2)
        assert a != b
        base = free_port_run(2, avoid=frozenset((a, b)))
        assert not {base, base + 1} & {a, b}
        socks = [socket.socket() for _ in range(2)]
        try:
            for k, s in enumerate(socks):
                s.bind(("0.0.0.0", base + k))
        finally:
            for s in socks:
                s.close()


def test_a_port_held_on_the_wildcard_address_is_not_free():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not localproc._bindable(port, "127.0.0.1")
