"""Drive one LLMEngine from a dedicated thread and hand its outputs to asyncio.

Threads and ownership:
- The engine thread builds the engine (model load), then loops: wait for work,
  `step()`, publish a stats snapshot, and post the step's outputs to the event
  loop in ONE `call_soon_threadsafe` callback. It is the only thread that
  calls `step()` or `stats()`.
- The event loop calls only the engine's thread-safe entry points
  (`add_request`, `abort_request`, `has_unfinished_requests`) and owns every
  structure in this module except the stats snapshot (replaced whole, so
  readers on other threads see either the old or the new object).

Invariants:
- every sequence submitted belongs to exactly one `RequestGroup` until its
  finished output arrives; outputs of unknown sequences (aborted after a
  failed submission) are dropped;
- a sequence counts as queued (for the 429 bound) from submission until its
  first output, whatever that output is.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.roles import Handoff
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.api import errors

log = logging.getLogger("kvmesh.server")


class ServerState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class ServedEngine(Protocol):
    """What the server drives: `LLMEngine`, or a test's fake. Every method but `wake` and the
    submissions (`add_request`, `abort_request`: thread-safe, queued for the step) is called on
    the engine's own thread only."""

    wake: Callable[[], None] | None  # set by the server: a submission wakes an idle step loop

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    priority: int = 0, arrival_time: float | None = None,
                    handoff: Handoff | None = None, cache_salt: str | None = None,
                    state_hints: Sequence[int] = ()) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def idle_tick(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def has_pending_commands(self) -> bool: ...
    def has_timers(self) -> bool: ...
    def stats(self) -> Any: ...


@dataclass(frozen=True)
class SeqSubmission:
    """One engine sequence to start."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    handoff: Handoff | None = None
    """The sequence's role in a KV handoff (engine/roles.py), if any."""
    cache_salt: str | None = None
    state_hints: tuple[int, ...] = ()
    """Hybrid models: prompt positions worth a checkpoint (``Request.state_hints``)."""


class RequestGroup:
    """The engine sequences of one API request (its n choices), read by one consumer on the event loop."""

    def __init__(self, seq_ids: list[str]) -> None:
        self.seq_ids = list(seq_ids)
        self.unfinished: set[str] = set(seq_ids)
        self._outputs: deque[RequestOutput] = deque()
        self._wakeup = asyncio.Event()
        self._error: BaseException | None = None
        self.released = False

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def _push(self, outs: list[RequestOutput]) -> None:
        self._outputs.extend(outs)
        for o in outs:
            if o.finished:
                self.unfinished.discard(o.request_id)
        self._wakeup.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wakeup.set()

    async def next_outputs(self) -> list[RequestOutput]:
        """Everything that arrived since the last call (waits for at least one output).

        Returns [] once every sequence has finished and all outputs were taken;
        raises the engine's failure if the engine died.
        """
        while not self._outputs:
            if self._error is not None:
                raise self._error
            if not self.unfinished:
                return []
            await self._wakeup.wait()
            self._wakeup.clear()
        items = list(self._outputs)
        self._outputs.clear()
        return items


def retry_after_seconds(num_queued: int, max_num_seqs: int, recent_e2e_s: float | None) -> int:
    """A Retry-After hint: the time for the queue ahead to drain through the batch, in [1, 60] s."""
    if recent_e2e_s is None or max_num_seqs < 1:
        return 1
    return int(min(60, max(1, math.ceil(recent_e2e_s * num_queued / max_num_seqs))))


class AsyncEngine:
    """The server's handle on the engine: submission, aborts, output dispatch, lifecycle."""

    def __init__(self, factory: Callable[[], Any], *, max_waiting: int = 0) -> None:
        """`factory` builds the engine (on the engine thread). `max_waiting` <= 0 means no queue bound.

        Hooks (set before start, run on the event loop): `on_finished(output)`
        for each finished sequence, `on_token_gap(seconds, num_tokens)` for each
        output that carries tokens after a request's first, `on_dispatch_lag(s)`
        per step: how long its outputs waited for the event loop.
        """
        self._factory = factory
        self.max_waiting = max_waiting
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self.on_token_gap: Callable[[float, int], None] | None = None
        self.on_dispatch_lag: Callable[[float], None] | None = None
        self._load_callbacks: list[Callable[[], None]] = []
        self.engine: Any = None  # a ServedEngine once loaded (Any: the server reads its config and tokenizer too)
        self.state = ServerState.LOADING
        self.failure: BaseException | None = None
        self.stats: Any = None  # latest EngineStats, replaced whole by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = False
        self._by_seq: dict[str, RequestGroup] = {}
        self._last_token_t: dict[str, float] = {}
        self._queued: set[str] = set()
        self._groups: set[RequestGroup] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._e2e_ewma: float | None = None
        self.loaded = asyncio.Event()

    # ---- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (it loads the model first). Call on the event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="kvmesh-engine", daemon=True)
        self._thread.start()

    def add_load_callback(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the event loop once the engine is loaded (at once if it already is)."""
        if self.engine is not None and self.loaded.is_set():
            fn()
        else:
            self._load_callbacks.append(fn)

    @property
    def ready(self) -> bool:
        return self.state is ServerState.READY

    @property
    def num_active_requests(self) -> int:
        """API requests holding a group (submitted and not yet released by their handler)."""
        return len(self._groups)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; in-flight ones go on."""
        if self.state in (ServerState.READY, ServerState.LOADING):
            self.state = ServerState.DRAINING

    def end_drain(self) -> None:
        """Take requests again after a cancelled drain (ready, or loading if the model is not yet)."""
        if self.state is ServerState.DRAINING:
            self.state = ServerState.READY if self.engine is not None and self.loaded.is_set() else ServerState.LOADING

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no API request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def abort_all(self) -> None:
        for g in list(self._groups):
            self.abort(g)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after it finishes its current step."""
        if self.state is not ServerState.FAILED:
            self.state = ServerState.STOPPED
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # ---- requests (event loop) ----------------------------------------------------
    def check_accepting(self, num_seqs: int) -> None:
        """Raise the API error that refuses `num_seqs` new sequences now, if any."""
        if self.state is ServerState.LOADING:
            raise errors.not_ready()
        if self.state is ServerState.FAILED:
            raise errors.engine_failed(str(self.failure))
        if self.state is not ServerState.READY:
            raise errors.shutting_down()
        if self.max_waiting > 0 and len(self._queued) + num_seqs > self.max_waiting:
            raise errors.queue_full(self.max_waiting, retry_after_seconds(
                len(self._queued), self.engine.config.max_num_seqs, self._e2e_ewma))

    def submit(self, seqs: list[SeqSubmission], *, priority: int = 0,
               arrival_time: float | None = None) -> RequestGroup:
        """Add all of `seqs` to the engine or none of them; engine validation errors propagate."""
        self.check_accepting(len(seqs))
        added: list[str] = []
        try:
            for s in seqs:
                self.engine.add_request(s.request_id, s.prompt_token_ids, s.params, priority=priority,
                                        arrival_time=arrival_time, handoff=s.handoff, cache_salt=s.cache_salt,
                                        state_hints=s.state_hints)
                added.append(s.request_id)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            self._wake.set()
            raise
        group = RequestGroup(added)
        for rid in added:
            self._by_seq[rid] = group
            self._queued.add(rid)
        self._groups.add(group)
        self._idle.clear()
        self._wake.set()
        return group

    def abort(self, group: RequestGroup) -> None:
        """Abort the group's unfinished sequences; their final "abort" outputs still arrive."""
        for rid in group.unfinished:
            self.engine.abort_request(rid)
        if group.unfinished:
            self._wake.set()

    def release(self, group: RequestGroup) -> None:
        """The handler is done with `group` (normally or not): abort what is left and stop tracking it."""
        if group.released:
            return
        group.released = True
        if group.unfinished:
            # Their final "abort" outputs still pass through _dispatch, which
            # counts them and forgets the sequences; nobody reads the group.
            self.abort(group)
        self._groups.discard(group)
        if not self._groups:
            self._idle.set()

    # ---- engine thread --------------------------------------------------------------
    def _thread_main(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to the event loop, which exits the server
            log.exception("engine failed to load")
            loop.call_soon_threadsafe(self._on_engine_failure, e)
            return
        self.engine = engine
        engine.wake = self._wake.set
        self.stats = engine.stats()
        loop.call_soon_threadsafe(self._on_loaded)
        try:
            self._run(engine, loop)
        except BaseException as e:  # noqa: BLE001
            log.exception("engine step failed")
            loop.call_soon_threadsafe(self._on_engine_failure, e)

    def _run(self, engine: ServedEngine, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop:
            if not engine.has_unfinished_requests():
                if engine.has_pending_commands() or engine.has_timers():
                    # KV transfer commands and expiries need no request to run.
                    outs = engine.idle_tick()
                    self.stats = engine.stats()
                    if outs:
                        loop.call_soon_threadsafe(self._dispatch, outs, time.monotonic())
                    if engine.has_unfinished_requests():
                        continue
                # A submission sets _wake after add_request, so either we see its
                # request above or the wait returns at once.
                self._wake.wait(timeout=0.5 if engine.has_timers() else 1.0)
                self._wake.clear()
                # Counters also move between steps (a cache node confirming a write-through):
                # an idle engine's /metrics must not stay at its last step's figures.
                self.stats = engine.stats()
                continue
            before = self.stats.num_steps if self.stats is not None else -1
            outs = engine.step()
            now = time.monotonic()
            self.stats = stats = engine.stats()
            if outs:
                loop.call_soon_threadsafe(self._dispatch, outs, now)
            elif stats.num_steps == before:
                # Nothing was schedulable (e.g. requests just added but not yet
                # visible): yield briefly instead of spinning on the lock.
                self._wake.wait(timeout=0.002)
                self._wake.clear()

    # ---- event-loop callbacks ---------------------------------------------------------
    def _on_loaded(self) -> None:
        for fn in self._load_callbacks:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - e.g. a KV transfer port that cannot bind
                log.exception("starting the server's parts after the model load failed")
                self._on_engine_failure(e)
                return
        if self.state is ServerState.LOADING:
            self.state = ServerState.READY
        self.loaded.set()

    def _on_engine_failure(self, exc: BaseException) -> None:
        self.state = ServerState.FAILED
        self.failure = exc
        err = errors.engine_failed(f"{type(exc).__name__}: {exc}")
        for g in list(self._groups):
            g._fail(err)
        self.loaded.set()

    def _dispatch(self, outs: list[RequestOutput], t: float) -> None:
        """All outputs of one step: route them to their groups, one wakeup per group."""
        if self.on_dispatch_lag is not None:
            self.on_dispatch_lag(time.monotonic() - t)
        batches: dict[RequestGroup, list[RequestOutput]] = {}
        for out in outs:
            rid = out.request_id
            group = self._by_seq.get(rid)
            if group is None:
                continue
            self._queued.discard(rid)
            if out.new_token_ids and self.on_token_gap is not None:
                prev = self._last_token_t.get(rid)
                if prev is not None:
                    self.on_token_gap(t - prev, len(out.new_token_ids))
                self._last_token_t[rid] = t
            if out.finished:
                del self._by_seq[rid]
                self._last_token_t.pop(rid, None)
                self._note_finished(out)
            batch = batches.get(group)
            if batch is None:
                batches[group] = [out]
            else:
                batch.append(out)
        for group, batch in batches.items():
            group._push(batch)

    def _note_finished(self, out: RequestOutput) -> None:
        if self.on_finished is not None:
            self.on_finished(out)
        m = out.metrics
        if out.finish_reason != "abort" and m.finished_time is not None:
            e2e = m.finished_time - m.arrival_time
            self._e2e_ewma = e2e if self._e2e_ewma is None else 0.9 * self._e2e_ewma + 0.1 * e2e
