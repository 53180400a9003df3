"""UCX settings every kvmesh process that uses ucxx applies before ucxx creates its context.

ucxx reads ``UCX_*`` and ``UCXPY_*`` variables once, when its context is created (the first
listener or endpoint), so these must be set before that; an explicit value in the environment
always wins. Applied by the server entry points (`kvmesh serve`, `kvmesh cache-node`), whose
ucxx users all share one event loop (``loop_thread.shared_loop``, or the cache node's own), as
Python futures require; library users that run several loops keep ucxx's defaults.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

DEFAULTS = {
    # A restarted process must get its UCX port back at once, while connections of its previous
    # life sit in TIME_WAIT.
    "UCX_TCP_CM_REUSEADDR": "y",
    # Without Python futures, a request waiting for a message (a listener's idle connection
    # waiting for the next request) polls with asyncio.sleep(0) and keeps a whole core busy;
    # with them it sleeps until ucxx's progress thread completes it.
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    # UCX's TCP transport copies through segments of this size (default 8 KiB): KV payloads are
    # hundreds of KiB per block, and bigger segments cut the per-segment work. Measured with
    # bench/kv_transfer.py's network path (docs/benchmarks.md, "KV transfer").
    "UCX_TCP_TX_SEG_SIZE": "512k",
    "UCX_TCP_RX_SEG_SIZE": "512k",
}


def apply_ucx_defaults(bind_host: str | None = None, peers: tuple[str, ...] = (),
                       env: MutableMapping[str, str] = os.environ) -> None:
    """``bind_host``: the address the process's listeners bind. Besides the listener
    (listener.py), UCX's TCP transport listens on every network device it uses; bound to one
    address, the process gives UCX only that address's device (an explicit ``UCX_NET_DEVICES``
    wins), so nothing of it listens elsewhere. Such a process reaches peers only through that
    device, so ``peers`` (hosts it is configured to reach, e.g. its cache node) held elsewhere keep
    every device; peers learnt later (a decode engine named per request) must be reachable there.
    ``env``: the environment to set (the process's)."""
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    device = net_device_of(bind_host) if bind_host else None
    elsewhere = [p for p in peers if net_device_of(_resolve(p)) != device]
    if device is not None and "UCX_NET_DEVICES" not in env:
        if elsewhere:
            log.warning("KV transfer: UCX listens on every network device although %s is bound, to reach %s",
                        bind_host, ", ".join(elsewhere))
        else:
            env["UCX_NET_DEVICES"] = device
            log.info("KV transfer: UCX uses network device %s only (%s is bound)", device, bind_host)
    plain_pages_for_numpy()


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return host


def net_device_of(host: str) -> str | None:
    """The network interface holding ``host`` (an IPv4 literal or ``localhost``); None for a
    wildcard, a name, or an address no interface holds (UCX then keeps its default: every device)."""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if addr.version != 4 or addr.is_unspecified:
        return None
    if addr.is_loopback:  # the loopback device holds all of 127/8, and reports 127.0.0.1
        addr = ipaddress.IPv4Address("127.0.0.1")
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == addr:
            return name
    return None


def _ipv4_of(interface: str) -> ipaddress.IPv4Address | None:
    SIOCGIFADDR = 0x8915  # noqa: N806 - the ioctl's name in <linux/sockios.h>
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return ipaddress.IPv4Address(raw[20:24])


def plain_pages_for_numpy() -> None:
    """Stop numpy from advising huge pages for its large arrays (it does, from 4 MiB up).

    Received blocks land in fresh numpy arrays; where the kernel's THP defrag setting is
    ``madvise`` (a common default), that advice makes each first touch compact memory for a huge
    page: on a 2-core Xeon VM here, writing a fresh 188 MB array ran at 0.25 GB/s with the advice
    and 1.75 GB/s without (bench/kv_transfer.py prints both), below a loopback socket either way
    with it. Transfer processes allocate and fill such buffers all the time, so they go without.
    """
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is not None:
        setter(False)


def stop_ucx_notifier() -> None:
    """Stop ucxx's Python-future notifier thread, if ucxx is in use: with it running, a process
    can hang at exit waiting for that thread. Call once, when the process stops transferring."""
    import sys

    ucxx = sys.modules.get("ucxx")
    if ucxx is not None:
        ucxx.stop_notifier_thread()
