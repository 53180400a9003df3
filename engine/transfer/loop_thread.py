"""An asyncio event loop on its own thread, so plain threads (an engine's step loop) can use ucxx.

ucxx calls need a running loop. ``LoopThread.submit(coro)`` hands a coroutine to the loop and
returns a ``concurrent.futures.Future`` at once: the caller polls ``done()`` or waits with
``result(timeout)``, and never runs transport code on its own thread.

Invariants: ``submit`` never blocks on the loop; after ``close()`` every future it returned is
done (finished, failed or cancelled) and the thread has exited.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopClosed(RuntimeError):
    """The loop thread was closed; no more work is accepted."""


class LoopThread:
    def __init__(self, name: str = "kvmesh-transfer") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for t in pending:
                t.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:
                coro.close()
                raise LoopClosed("the transfer loop thread is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (for setup/teardown code, never a step thread)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.call() from the loop thread itself would deadlock")
        return self.submit(coro).result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what is still running, stop the loop and join the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def shared_loop() -> LoopThread:
    """The process's transfer loop: created on first use, never closed (it ends with the process).

    ucxx keeps one context per process and, with Python futures on (``ucx_env``), completes every
    request on the event loop that created that context; so every ucxx user of a server process
    (decode endpoint, links to decode engines, the cache-node link) runs on this one loop. This
    is the one piece of process-wide state here, and it mirrors ucxx's own.
    """
    global _shared
    with _shared_lock:
        if _shared is None or _shared._closed:
            _shared = LoopThread("kvmesh-transfer")
        return _shared
