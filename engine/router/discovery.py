"""Which engines exist, which are healthy, and what each has cached.

Sources are a fixed URL list (``--engines``) or headless Services (``--decode-service
HOST:PORT``) whose DNS name resolves to one address per ready pod; services are re-resolved
every ``resolve_interval_s``. Each engine is probed on ``/ready`` every ``health_interval_s``;
a refused connection or a 503 (from a probe or from a proxied request) takes it out until a
probe succeeds again. For a healthy engine the fleet reads ``/kv/info`` once and runs a KV
event subscriber that keeps the shared ``PrefixIndex`` in step with the engine's cache.

Invariants: the index holds entries only for engines in the fleet (a removed engine's
subscriber is stopped and its entries are freed; a probe that finds its engine removed while it
awaited changes nothing); an engine's entries come from the engine process now at its address:
when it turns healthy again, or its ``/ready`` reports another ``engine_id`` (a restart at the
same address), its entries are dropped and reloaded from a fresh snapshot; ``ready()`` is true
only once every healthy engine that publishes KV events has had its first snapshot applied; an
engine whose hash chain differs from the router's (hash function, root, a tokenizer other than
the router's, or a block size or extra key other than the pool's) is never prefix-matched, and
``mismatches()`` names the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvmesh.engine.block_hash import HASH_FUNCTION, ROOT_HASH, max_hit_blocks
from kvmesh.engine.kv.events import KVEventRecord, KVSnapshot
from kvmesh.engine.router.index import PrefixIndex, PrefixMatch
from kvmesh.engine.router.policies import Endpoint
from kvmesh.engine.router.prompt import PromptInfo, common_hash_spec
from kvmesh.engine.router.rates import PrefillClock, decode_seconds_per_seq, interval_median
from kvmesh.engine.router.routed import RoutedPrefixes

log = logging.getLogger("kvmesh.router.discovery")


class DiscoveryError(ValueError):
    """A discovery source is malformed (the message names it and the expected form)."""


@dataclass(frozen=True)
class ServiceSource:
    """A DNS name to resolve to engine addresses, all serving on ``port``."""

    host: str
    port: int


def parse_hostport(text: str, flag: str) -> ServiceSource:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6 literals) as a ``ServiceSource``."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(f"{flag} {text!r}: expected HOST:PORT, e.g. llm-decode.serving.svc:8000")
    return ServiceSource(host, int(port))


def parse_engine_urls(text: str, flag: str = "--engines") -> list[str]:
    """``--engines`` (or ``--prefill-engines``) as normalized base URLs (no trailing slash)."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise DiscoveryError(f"{flag}: {u!r} is not an http(s) URL, e.g. http://127.0.0.1:8001")
    if not urls:
        raise DiscoveryError(f"{flag}: give at least one engine URL")
    return urls


def url_for(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def membership_change(current: Iterable[str], wanted: Iterable[str]) -> tuple[list[str], list[str]]:
    """(added, removed) engine URLs, each sorted."""
    cur, want = set(current), set(wanted)
    return sorted(want - cur), sorted(cur - want)


@dataclass(frozen=True)
class EngineReport:
    """What one ``/metrics`` scrape tells the router: running + waiting sequences, free KV
    blocks of the primary pool and its size in blocks, the running batch, and the inter-token
    latency histogram's cumulative buckets as (le, count), ascending (each None when the engine
    does not report it)."""

    load: int | None = None
    free_blocks: int | None = None
    num_blocks: int | None = None
    running: int | None = None
    itl_buckets: tuple[tuple[float, float], ...] | None = None


_RUNNING_GAUGE = "kvmesh_num_requests_running"
_LOAD_GAUGES = (_RUNNING_GAUGE, "kvmesh_num_requests_waiting")
_FREE_BLOCKS_GAUGE = "kvmesh_kv_cache_free_blocks"
_BLOCKS_GAUGE = "kvmesh_kv_cache_blocks"
_ITL_BUCKET = "kvmesh_inter_token_latency_seconds_bucket"


def engine_report_from_metrics(text: str) -> EngineReport:
    """An ``EngineReport`` from an engine's ``/metrics`` text.

    A line scan instead of a full exposition parse: it runs every probe interval per engine.
    The name must end at ``{`` or a space, so a longer metric sharing the prefix never counts.
    """
    load, free, total, seen_load = 0.0, None, None, False
    running: int | None = None
    itl: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith("kvmesh_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _LOAD_GAUGES:
            with contextlib.suppress(ValueError, IndexError):
                value = float(line.rsplit(" ", 1)[1])
                load += value
                seen_load = True
                if name == _RUNNING_GAUGE:
                    running = (running or 0) + int(value)
        elif name in (_FREE_BLOCKS_GAUGE, _BLOCKS_GAUGE) and ('tier="' not in line or 'tier="gpu"' in line):
            # Only the primary pool's rows: blocks a decode engine can reserve for a transfer, and
            # the pool an engine's prefix cache lives in.
            with contextlib.suppress(ValueError, IndexError):
                value = int(float(line.rsplit(" ", 1)[1]))
                if name == _BLOCKS_GAUGE:
                    total = value
                else:
                    free = value
        elif name == _ITL_BUCKET:
            with contextlib.suppress(ValueError, IndexError):
                le = float(line.split('le="', 1)[1].split('"', 1)[0])
                itl[le] = itl.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return EngineReport(int(load) if seen_load else None, free, total, running,
                        tuple(sorted(itl.items())) if itl else None)


_ROOT_HEX = ROOT_HASH.hex()


def chain_mismatch(info: dict[str, Any]) -> str | None:
    """The first ``/kv/info`` field whose hash chain differs from the router's own (None: same)."""
    if info.get("hash_function", HASH_FUNCTION) != HASH_FUNCTION:
        return "hash_function"
    if info.get("root_hash", _ROOT_HEX) != _ROOT_HEX:
        return "root_hash"
    return None


def resync_reason(state: "EngineState", engine_id: str | None) -> str | None:
    """Why a healthy probe answer makes the router's view of ``state`` stale (None: it does not):
    the engine was out (it may have restarted or missed events), or ``/ready`` names another
    ``engine_id`` than its ``/kv/info`` did (another process at the same address)."""
    if state.info is None:
        return None  # not loaded yet: the probe loads it
    if engine_id and state.info.get("engine_id") not in (None, engine_id):
        return "restarted"
    return None if state.healthy else "is back"


def engine_load_from_metrics(text: str) -> int | None:
    """Running + waiting sequences from an engine's ``/metrics`` text (None if absent)."""
    return engine_report_from_metrics(text).load


@dataclass
class EngineState:
    """One engine as the router sees it. ``inflight`` and ``queued_prefill_tokens`` are the
    router's own accounting; ``reported_load`` and ``free_blocks`` are the engine's last scraped
    running+waiting sequences and free KV blocks (None until reported). ``prefill`` times the
    queued prefill as it drains (the dispatcher feeds it); ``decode_s_per_seq`` is the last
    scrape interval's decode step time per running sequence (None until measured)."""

    url: str
    healthy: bool = False
    draining: bool = False
    inflight: int = 0
    queued_prefill_tokens: int = 0
    reported_load: int = 0
    free_blocks: int | None = None
    num_blocks: int | None = None
    info: dict[str, Any] | None = None
    subscriber: Any = None
    task: asyncio.Task | None = None
    chain: str | None = None  # chain_mismatch(info), kept with info: the request path reads it
    warned_mismatch: str | None = None
    prefill: PrefillClock = field(default_factory=PrefillClock)
    decode_s_per_seq: float | None = None
    itl_seen: tuple[tuple[float, float], ...] | None = None  # the last scrape's ITL buckets

    def observe_report(self, report: EngineReport) -> None:
        """Fold one ``/metrics`` scrape into the load view (a missing value keeps the last one)."""
        if report.load is not None:
            self.reported_load = report.load
        if report.free_blocks is not None:
            self.free_blocks = report.free_blocks
        if report.num_blocks is not None:
            self.num_blocks = report.num_blocks
        if report.itl_buckets is not None:
            per_seq = decode_seconds_per_seq(interval_median(self.itl_seen, report.itl_buckets), report.running)
            if per_seq is not None:
                self.decode_s_per_seq = per_seq
            self.itl_seen = report.itl_buckets

    @property
    def block_size(self) -> int | None:
        return int(self.info["block_size"]) if self.info else None

    @property
    def extra(self) -> bytes | None:
        return bytes.fromhex(self.info["extra_key"]) if self.info and self.info.get("extra_key") else None

    @property
    def tokenizer(self) -> str | None:
        """The fingerprint of the engine's tokenizer (None: not reported)."""
        return self.info.get("tokenizer") if self.info else None

    @property
    def hybrid(self) -> bool:
        """The engine runs a hybrid model (``/kv/info``): its prefix hits end at its last block
        with a recurrent-state checkpoint."""
        return bool(self.info.get("hybrid")) if self.info else False

    @property
    def transfer_port(self) -> int | None:
        """The KV transfer port a decode engine reports in ``/kv/info`` (None: it receives no KV)."""
        port = self.info.get("transfer_port") if self.info else None
        return int(port) if port else None

    @property
    def synced(self) -> bool:
        """Initial KV state loaded (engines that publish no events count as synced)."""
        if self.info is None:
            return False
        return self.subscriber is None or self.subscriber.synced.is_set()

    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, self.healthy, self.draining, max(self.inflight, self.reported_load),
                        self.queued_prefill_tokens, self.free_blocks, self.prefill.seconds_per_token(),
                        self.decode_s_per_seq)


SubscriberFactory = Callable[[str, dict[str, Any], Callable[..., None], Callable[[KVSnapshot], None],
                              aiohttp.ClientSession], Any]
"""(engine url, its /kv/info, on_event, on_reset, the fleet's HTTP session) -> a subscriber or None."""


def default_subscriber_factory(url: str, info: dict[str, Any], on_event: Callable[..., None],
                               on_reset: Callable[[KVSnapshot], None], session: aiohttp.ClientSession,
                               token: Callable[[], str | None] = lambda: None) -> Any:
    """``token``: the internal token, for engines whose KV events are CURVE-authenticated."""
    from kvmesh.engine.kv.event_subscriber import KVEventSubscriber

    return KVEventSubscriber.from_info(url, info, on_event, on_reset, session=session, token=token())


@dataclass
class Fleet:
    """The engine pool: membership, health, load reports and the prefix index they feed."""

    session: aiohttp.ClientSession
    urls: list[str] = field(default_factory=list)
    services: list[ServiceSource] = field(default_factory=list)
    track_kv: bool = True
    resolve_interval_s: float = 5.0
    health_interval_s: float = 2.0
    probe_timeout_s: float = 2.0
    subscriber_factory: SubscriberFactory = default_subscriber_factory
    index: PrefixIndex = field(default_factory=PrefixIndex)
    routed: RoutedPrefixes = field(default_factory=RoutedPrefixes)  # for engines without events
    engines: dict[str, EngineState] = field(default_factory=dict)
    on_removed: Callable[[str], None] = lambda url: None
    # The router's tokenizer fingerprint: an engine reporting another tokenizes prompts into
    # other ids (so other block hashes) and is routed by load only. None: no check (no tokenizer).
    tokenizer: str | None = None
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.urls and not self.services:
            raise DiscoveryError("no engines to route to: pass --engines URL,... or --decode-service HOST:PORT")

    # ---- views ---------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        return [e.endpoint() for e in self.engines.values()]

    def prefix_matches(self, info: PromptInfo) -> tuple[dict[str, PrefixMatch], int]:
        """(each engine's longest cached prefix of the prompt, the block size they are in blocks of).

        Only engines hashing with the pool's majority (block size, extra key) are matched: a
        hash chain computed for another spec names other blocks. Empty when the prompt is not
        tokenized.
        """
        if not info.token_ids:
            return {}, 16
        spec = self._hash_spec()
        if spec is None:
            return {}, 16
        block_size, extra = spec
        hashes = info.hashes(block_size, extra)
        # A hybrid engine cuts its hit back from where its lookup stops, so stop there too.
        looked_up = hashes[:max_hit_blocks(len(info.token_ids), block_size, whole=False)]
        return {url: self.routed.match(url, hashes) if self.routed_only(st)
                else self.index.match(url, looked_up, restore_points=True) if st.hybrid
                else self.index.match(url, hashes)
                for url, st in self.engines.items() if self._matchable(st, block_size, extra)}, block_size

    def state_hints(self, info: PromptInfo) -> tuple[int, ...]:
        """Prompt positions where a hybrid engine computing ``info`` should checkpoint its state
        (``PrefixIndex.wanted_checkpoints`` over this pool's hybrid engines, in tokens): the
        router tells the engine it picks what any engine of the pool saw, so the third prompt
        sharing a prefix resumes wherever the second went."""
        spec = self._hash_spec() if info.token_ids else None
        if spec is None:
            return ()
        block_size, extra = spec
        hybrid = [u for u, st in self.engines.items() if st.hybrid and self._matchable(st, block_size, extra)]
        if not hybrid:
            return ()
        looked_up = info.hashes(block_size, extra)[:max_hit_blocks(len(info.token_ids), block_size, whole=False)]
        return tuple(j * block_size for j in self.index.wanted_checkpoints(hybrid, looked_up))

    def note_routed(self, url: str, info: PromptInfo) -> None:
        """``info``'s prompt was sent to ``url``: the record that stands in for the KV events of an
        engine that publishes none (engine/router/routed.py)."""
        st = self.engines.get(url)
        spec = self._hash_spec() if st is not None and self.routed_only(st) and info.token_ids else None
        if spec is None or not self._matchable(st, *spec):
            return
        self.routed.record(url, info.hashes(*spec), st.num_blocks)

    def routed_only(self, st: EngineState) -> bool:
        """The router's record of what it sent is ``st``'s prefix signal: its KV info is loaded and
        it publishes no events (or this router does not follow them). A hybrid engine is left out:
        its hits also need checkpoints that only its events report."""
        return bool(st.info) and not st.hybrid and not (self.track_kv and st.info.get("kv_events"))

    def _matchable(self, st: EngineState, block_size: int, extra: bytes) -> bool:
        return st.block_size == block_size and st.extra == extra and self._same_chain(st)

    def _same_chain(self, st: EngineState) -> bool:
        return st.chain is None and (self.tokenizer is None or st.tokenizer in (None, self.tokenizer))

    def _hash_spec(self) -> tuple[int, bytes] | None:
        return common_hash_spec([(e.block_size, e.extra) for e in self.engines.values() if self._same_chain(e)])

    def mismatches(self) -> dict[str, str]:
        """Engine URL -> the field that keeps it out of prefix matching (engines with KV info only)."""
        spec = self._hash_spec()
        out = {}
        for url, st in self.engines.items():
            if not st.info or st.block_size is None:
                continue
            name = st.chain
            if name is None and not self._same_chain(st):
                name = "tokenizer"
            if name is None and spec is not None:
                name = "block_size" if st.block_size != spec[0] else "extra_key" if st.extra != spec[1] else None
            if name is not None:
                out[url] = name
        return out

    def num_healthy(self) -> int:
        return sum(1 for e in self.engines.values() if e.healthy)

    def ready(self) -> bool:
        healthy = [e for e in self.engines.values() if e.healthy]
        return bool(healthy) and all(e.synced for e in healthy)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Resolve and probe once, then keep doing both in the background."""
        await self.refresh_members()
        await self.probe_all()
        self._tasks = [asyncio.create_task(self._every(self.health_interval_s, self.probe_all))]
        if self.services:
            self._tasks.append(asyncio.create_task(self._every(self.resolve_interval_s, self.refresh_members)))

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until ``ready()`` (True) or ``timeout_s`` passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.ready():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        for url in list(self.engines):
            await self._remove(url)

    async def _every(self, interval: float, fn: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # noqa: BLE001 - a failed round must not end discovery
                log.exception("router discovery round failed")

    # ---- membership ----------------------------------------------------------------------
    async def resolve(self) -> list[str]:
        """Every engine URL the sources name now (a failed lookup yields no addresses)."""
        urls = list(self.urls)
        loop = asyncio.get_running_loop()
        for src in self.services:
            try:
                infos = await loop.getaddrinfo(src.host, src.port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("cannot resolve %s: %s", src.host, e)
                continue
            urls.extend(url_for(str(sa[0]), src.port) for *_, sa in infos)
        return sorted(set(urls))

    async def refresh_members(self) -> None:
        added, removed = membership_change(self.engines, await self.resolve())
        for url in removed:
            log.info("engine %s left the pool", url)
            await self._remove(url)
        for url in added:
            log.info("engine %s joined the pool", url)
            self.engines[url] = EngineState(url)

    async def _remove(self, url: str) -> None:
        state = self.engines.pop(url, None)
        if state is None:
            return
        await self._stop_subscriber(state)
        self.index.remove_engine(url)
        self.routed.remove_engine(url)
        self.on_removed(url)

    # ---- health --------------------------------------------------------------------------
    def mark_failed(self, url: str, why: str) -> None:
        """Take an engine out now (a refused connection or a 503 seen by the proxy)."""
        state = self.engines.get(url)
        if state is not None and state.healthy:
            log.warning("engine %s taken out: %s", url, why)
            state.healthy = False

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(s) for s in list(self.engines.values())))
        for url, name in self.mismatches().items():
            st = self.engines[url]
            if st.warned_mismatch != name:
                st.warned_mismatch = name
                log.warning("engine %s hashes KV blocks with another %s than the router and the pool "
                            "(/kv/info: %s): routed by load only, never by prefix", url, name,
                            (st.info or {}).get(name))

    def _current(self, state: EngineState) -> bool:
        """Whether ``state`` is still this fleet's engine at its URL (checked after every await:
        an engine removed, or removed and re-added, meanwhile must not be written to)."""
        return self.engines.get(state.url) is state

    async def probe(self, state: EngineState) -> None:
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        try:
            async with self.session.get(state.url + "/ready", timeout=timeout) as r:
                body = await r.json(content_type=None) if r.status in (200, 503) else {}
                ok = r.status == 200
            if not self._current(state):
                return
            body = body if isinstance(body, dict) else {}
            state.draining = body.get("state") == "draining"
            why = resync_reason(state, body.get("engine_id")) if ok else None
            if why is not None:
                log.info("engine %s %s: reloading its KV state from a fresh snapshot", state.url, why)
                await self._resync(state)
                if not self._current(state):
                    return
            if ok and state.info is None:
                await self._load_info(state, timeout)  # starts no subscriber for a removed engine
                if not self._current(state):
                    return
            if ok:
                async with self.session.get(state.url + "/metrics", timeout=timeout) as r:
                    text = await r.text() if r.status == 200 else None
                if not self._current(state):
                    return
                if text is not None:
                    state.observe_report(engine_report_from_metrics(text))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            ok = False
            if state.healthy:
                log.warning("engine %s failed its probe: %s", state.url, e or type(e).__name__)
        if not self._current(state):
            return
        if ok and not state.healthy:
            log.info("engine %s is healthy", state.url)
        state.healthy = ok

    async def _resync(self, state: EngineState) -> None:
        await self._stop_subscriber(state)
        if self._current(state):
            self.index.remove_engine(state.url)
            self.routed.remove_engine(state.url)
            state.info, state.chain = None, None

    async def _load_info(self, state: EngineState, timeout: aiohttp.ClientTimeout) -> None:
        async with self.session.get(state.url + "/kv/info", timeout=timeout) as r:
            if r.status == 404:
                state.info = {}  # an engine without KV info: routed by load only
                return
            r.raise_for_status()
            info = await r.json()
        if not self._current(state):
            return
        state.info, state.chain = info, chain_mismatch(info)
        if self.track_kv and info.get("kv_events") and state.chain is None:
            self._start_subscriber(state)

    def _start_subscriber(self, state: EngineState) -> None:
        url, index = state.url, self.index

        def on_reset(snap: KVSnapshot) -> None:
            index.reset(url, snap)

        def on_event(*args: Any) -> None:
            rec = args[-1]
            index.apply(url, rec.event if isinstance(rec, KVEventRecord) else rec)

        sub = self.subscriber_factory(url, state.info or {}, on_event, on_reset, self.session)
        if sub is None:
            return
        state.subscriber = sub
        state.task = asyncio.create_task(sub.run(), name=f"kv-events {url}")

    async def _stop_subscriber(self, state: EngineState) -> None:
        if state.subscriber is not None:
            await state.subscriber.stop()
        if state.task is not None:
            state.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await state.task
        state.subscriber = state.task = None
