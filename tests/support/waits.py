"""Waiting for a condition, in threads and on an event loop, and for a server's metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_for(cond: Callable[[], Any], what: str = "condition", timeout: float = 10.0, every: float = 0.05) -> None:
    """Poll ``cond`` until it is truthy; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


async def until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """``wait_for`` on an event loop: polls without blocking it."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def wait_metric(proc: Any, name: str, want: float, timeout: float = 30, **labels: str) -> None:
    """Wait until ``proc.metric(name, **labels)`` (a ``processes.ServerProcess``) equals ``want``."""
    deadline = time.monotonic() + timeout
    while (got := proc.metric(name, **labels)) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} is {got}, expected {want}")
        time.sleep(0.2)


def nothing_held(p: Any, d: Any) -> None:
    """A prefill server ``p`` and a decode server ``d`` hold no handoff state and no blocks."""
    wait_metric(p, "kvmesh_kv_handoffs_held", 0)
    wait_metric(d, "kvmesh_kv_transfers_reserved", 0)
    wait_metric(d, "kvmesh_num_requests_running", 0)
    for proc in (p, d):
        total = proc.metric("kvmesh_kv_cache_blocks", tier="gpu")
        wait_metric(proc, "kvmesh_kv_cache_free_blocks", total, tier="gpu")
