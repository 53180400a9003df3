"""What a process listens on, read from the kernel (/proc), not from the process's own word."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


def listening_sockets(pid: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of ``pid`` (default: this process)."""
    proc = Path(f"/proc/{pid or os.getpid()}")
    inodes = set()
    for fd in (proc / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        lines = (proc / "net" / table).read_text().splitlines()[1:]
        for line in lines:
            cols = line.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                addr, port = cols[1].split(":")
                found.add((_address(addr, family), int(port, 16)))
    return found


def _address(hexaddr: str, family: int) -> str:
    raw = bytes.fromhex(hexaddr)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)) if family == socket.AF_INET6 else socket.inet_ntoa(words)


def outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None if it has none)."""
    for _, name in socket.if_nameindex():
        from kvmesh.engine.transfer.ucx_env import _ipv4_of

        addr = _ipv4_of(name)
        if addr is not None and not addr.is_loopback:
            return str(addr)
    return None
