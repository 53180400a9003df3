"""UCX settings every kvmesh process that uses ucxx applies before ucxx creates its context.

ucxx reads ``UCX_*`` and ``UCXPY_*`` variables once, when its context is created (the first
listener or endpoint), so these must be set before that; an explicit value in the environment
always wins. Applied by the server entry points (`kvmesh serve`, `kvmesh cache-node`), whose
ucxx users all share one event loop (``loop_thread.shared_loop``, or the cache node's own), as
Python futures require; library users that run several loops keep ucxx's defaults.
"""

from __future__ import annotations

import os

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


def apply_ucx_defaults() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
    plain_pages_for_numpy()


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
