"""Run ucxx operations so that no request is ever abandoned while UCX still owns it.

A ucxx send, receive or connect posts a request that UCX completes later, on its own threads,
into memory that Python owns: the buffer being sent or received and, with Python futures on, an
asyncio future that ucxx's notifier thread resolves. Cancelling the coroutine that awaits such a
request (a timeout, a gather that failed, a server closing) drops the last Python references to
those objects while the request is still posted: UCX then writes into freed memory or resolves a
freed future, and the interpreter crashes later in unrelated code (seen as a segfault in a
prefill engine after its handoff to a stalled decode engine timed out).

Invariant kept here: every posted operation runs to completion as a task that nothing cancels,
held in ``_posted`` until UCX completes it. A caller that stops waiting only stops waiting; to make
the operations finish it aborts the endpoint, which completes each of them with an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Process-wide like ucxx's own worker: a request outlives the Channel (and the coroutine) that
# posted it, so the references that keep its buffers alive cannot live on either.
_posted: set[asyncio.Task] = set()


def pending() -> int:
    """Operations posted and not yet completed by UCX (a gauge for tests and metrics)."""
    return len(_posted)


def _finished(task: asyncio.Task) -> None:
    _posted.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a failure nobody waits for any more is expected, not news


def start(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start ``coro`` (one ucxx operation) as a task held until it completes. Never cancel it."""
    task = asyncio.ensure_future(coro)
    _posted.add(task)
    task.add_done_callback(_finished)
    return task


def post(coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """Start ``coro`` and return an awaitable for its result; cancelling that does not cancel it."""
    return asyncio.shield(start(coro))


async def drain(timeout: float) -> int:
    """Wait up to ``timeout`` for every posted operation to complete; returns how many still run."""
    if _posted:
        await asyncio.wait(list(_posted), timeout=timeout)
    return len(_posted)
