"""`kvmesh up`: the local platform as child processes: a router in front of N colocated engines
(`--engines N`), or of N prefill and M decode engines (`--prefill N --decode M`, docs/disagg.md).

The plan (which processes, with which command lines, ports and thread counts) is a pure
function of the options, tested directly; the supervisor only starts what the plan says,
waits for each to be ready, prints status lines and stops everything together.

Supervisor invariants: every child runs in its own process group and is stopped (SIGTERM,
then SIGKILL after the grace period) whenever `up` exits, whatever the reason; when any child
exits on its own, `up` stops the rest and exits non-zero after printing that child's last log
lines; Ctrl-C or SIGTERM stops the router first (no new work), then the engines, and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.engine.util import fleet_args as fa
from kvmesh.engine.util.localproc import http_get, http_status, log_tail

_LOG_TAIL_LINES = 30


DEFAULT_ENGINES = 2


@dataclass(frozen=True)
class UpOptions:
    """``engines``: colocated engines (None: ``DEFAULT_ENGINES`` unless ``prefill``/``decode`` are
    given, which are the disaggregated form of the same choice: N prefill, M decode engines)."""

    engines: int | None = None
    prefill: int = 0
    decode: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    engine_base_port: int = 8100
    kv_events_base_port: int = 5557
    model: str = "default"
    policy: str = "cache-aware"
    threads: int | None = None  # per engine; None: split the cores evenly
    kv_cache_bytes: str | None = None
    serve_args: tuple[str, ...] = ()
    cache_node: bool = False  # one `kvmesh cache-node` that every engine writes through to and reloads from
    cache_node_port: int = 8090  # its HTTP port; its UCX port is the next one
    cache_node_memory: str = "1GiB"
    cpu_kv_bytes: str | None = None  # each engine's host KV tier
    auth_token_file: str | None = None  # the internal token every process checks (up writes one)
    api_key_files: tuple[str, ...] = ()  # client keys the router checks
    isolate_tenants: bool = False  # the router salts each key's requests (engines see its salt)
    kv_transfer_base_port: int = 8200  # decode engine j receives KV (UCX) on this port + j
    admission: str = "FirstCome"  # engine/util/fleet_args.py ADMISSIONS, against the two targets below
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)


@dataclass(frozen=True)
class ProcSpec:
    """One child process: its name, `kvmesh` arguments (without the program) and HTTP base URL."""

    name: str
    args: tuple[str, ...]
    url: str
    env: dict[str, str] = field(default_factory=dict)


class UpError(RuntimeError):
    """The local platform could not start or a process died; the message says which and why."""


def threads_per_engine(engines: int, cores: int, requested: int | None) -> int:
    """Each engine's torch threads: the request, or the cores split evenly (at least one)."""
    if requested is not None:
        if requested < 1:
            raise UpError(f"--threads must be >= 1, got {requested}")
        return requested
    return max(1, cores // max(1, engines))


def engine_roles(opts: UpOptions) -> list[tuple[str, str]]:
    """(process name, `kvmesh serve --role`) of every engine, in start order: prefill engines
    before decode engines; engine i (over all of them) gets the i-th HTTP and KV event ports."""
    if opts.disaggregated:
        if opts.engines is not None:
            raise UpError("--engines N runs colocated engines, --prefill N --decode M disaggregated ones: "
                          "give one form, not both")
        if opts.prefill < 1 or opts.decode < 1:
            raise UpError(f"--prefill and --decode must both be >= 1 (a disaggregated platform needs both pools), "
                          f"got --prefill {opts.prefill} --decode {opts.decode}")
        return [(f"prefill-{i}", "prefill") for i in range(opts.prefill)] + \
            [(f"decode-{j}", "decode") for j in range(opts.decode)]
    engines = DEFAULT_ENGINES if opts.engines is None else opts.engines
    if engines < 1:
        raise UpError(f"--engines must be >= 1, got {engines}")
    return [(f"engine-{i}", "both") for i in range(engines)]


def _engine_admission(opts: UpOptions) -> dict[str, float]:
    """Every engine's admission flags for ``opts.admission`` at the SLO targets given."""
    for flag, value in (("--slo-ttft-ms", opts.slo_ttft_ms), ("--slo-tpot-ms", opts.slo_tpot_ms)):
        if value is not None and not value > 0:  # also refuses NaN
            raise UpError(f"{flag} must be a positive number of milliseconds, got {value}")
    try:
        return fa.admission_fields(opts.admission, opts.slo_ttft_ms, opts.slo_tpot_ms)
    except fa.AdmissionError as e:
        if not e.missing:
            raise UpError(f"--admission must be one of {', '.join(fa.ADMISSIONS)}, got {opts.admission!r}") from None
        flags = " and ".join(f"--slo-{t}-ms" for t in e.missing)
        raise UpError(f"--admission {opts.admission} admits against {flags}: give "
                      f"{'them' if len(e.missing) > 1 else 'it'}, or leave --admission at FirstCome") from None


def plan(opts: UpOptions, cores: int) -> list[ProcSpec]:
    """The cache node (with --cache-node), the engines, then the router that fronts them: the order
    they are started in (and stopped in reverse)."""
    if opts.isolate_tenants and not opts.api_key_files:
        raise UpError("--isolate-tenants needs --api-key-file: tenants are told apart by their API key")
    admission = _engine_admission(opts)
    roles = engine_roles(opts)
    n = len(roles)
    decoders = [i for i, (_, role) in enumerate(roles) if role == "decode"]
    transfer_port = {i: opts.kv_transfer_base_port + j for j, i in enumerate(decoders)}
    ports = [opts.port] + [opts.engine_base_port + i for i in range(n)]
    ports += [opts.kv_events_base_port + 2 * i + k for i in range(n) for k in (0, 1)]
    ports += list(transfer_port.values())
    if opts.cache_node:
        ports += [opts.cache_node_port, opts.cache_node_port + 1]
    if len(set(ports)) != len(ports) or any(not 0 < p < 65536 for p in ports):
        transfer = f", the KV transfer ports ({opts.kv_transfer_base_port}+j)" if decoders else ""
        raise UpError(f"the router port, the engine ports ({opts.engine_base_port}+i), the KV event ports "
                      f"({opts.kv_events_base_port}+2i, +2i+1){transfer} and the cache node's ports "
                      f"(HTTP, UCX = HTTP+1) must be distinct valid ports: {sorted(ports)}")
    threads = threads_per_engine(n, cores, opts.threads)
    # Each engine is told its thread count; the env keeps OpenMP/BLAS pools from oversubscribing.
    env = {"OMP_NUM_THREADS": str(threads)}
    specs: list[ProcSpec] = []
    node = f"{opts.host}:{opts.cache_node_port}" if opts.cache_node else None
    if node:
        specs.append(ProcSpec("cache-node", tuple(fa.cache_node_args(fa.CacheNodeLine(
            opts.cache_node_memory, host=opts.host, port=opts.cache_node_port, ucx_port=opts.cache_node_port + 1,
            auth_token_file=opts.auth_token_file))),
            f"http://{node}"))
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
    for i, (name, role) in enumerate(roles):
        port = opts.engine_base_port + i
        line = fa.EngineLine(role=role, model=opts.model, host=opts.host, port=port, num_threads=threads,
                             kv_events_port=opts.kv_events_base_port + 2 * i,
                             kv_transfer_port=transfer_port.get(i), kv_cache_bytes=opts.kv_cache_bytes,
                             cache_node=node, cpu_kv_bytes=opts.cpu_kv_bytes, auth_token_file=opts.auth_token_file,
                             **admission, extra=tuple(opts.serve_args))
        url = f"http://{opts.host}:{port}"
        urls[role].append(url)
        specs.append(ProcSpec(name, tuple(fa.serve_args(line)), url, env))
    prefill = fa.Pool(urls=tuple(urls["prefill"])) if urls["prefill"] else None
    router = fa.RouterLine(decode=fa.Pool(urls=tuple(urls["decode"] or urls["both"])), prefill=prefill,
                           policy=opts.policy, model=opts.model, host=opts.host, port=opts.port,
                           auth_token_file=opts.auth_token_file, api_key_files=opts.api_key_files,
                           isolate_tenants=opts.isolate_tenants)
    specs.append(ProcSpec("router", tuple(fa.router_args(router)), f"http://{opts.host}:{opts.port}"))
    return specs


def write_token(run_dir: Path) -> Path:
    """A fresh internal token in ``run_dir/auth-token``, readable by this user only (a new one per
    run: nothing outside this run's processes holds it)."""
    import secrets

    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / "auth-token").resolve()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    return path


def kvmesh_argv() -> list[str]:
    """How to run this same installation's CLI in a child (the interpreter, never PATH)."""
    return [sys.executable, "-m", "kvmesh"]


# ---- supervisor ---------------------------------------------------------------------------------

@dataclass
class Child:
    spec: ProcSpec
    log_path: Path
    proc: subprocess.Popen
    ready: bool = False

    def tail(self, n: int = _LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, n)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when `up` dies, even by SIGKILL, so a
    killed supervisor never leaves engines holding their ports (elsewhere: a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _start(spec: ProcSpec, run_dir: Path) -> Child:
    log_path = run_dir / f"{spec.name}.log"
    log = open(log_path, "wb")
    env = {**os.environ, **spec.env}
    proc = subprocess.Popen([*kvmesh_argv(), *spec.args], cwd=run_dir, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent)
    log.close()
    return Child(spec, log_path, proc)


def status_line(child: Child) -> str:
    """One line for `child`: state plus, for an engine, load read from its /metrics."""
    from kvmesh.engine.util.metrics import parse_samples, sample_value

    state = "ready" if child.ready else "starting"
    line = f"{child.spec.name:<9} pid {child.proc.pid:<7} {state:<8} {child.spec.url}"
    if not child.ready or child.spec.name.startswith(("router", "cache-node")):
        return line
    got = http_get(child.spec.url + "/metrics", timeout_s=2)
    try:
        samples = parse_samples(got[1].decode()) if got is not None and got[0] == 200 else None
    except ValueError:
        samples = None
    if samples is None:
        return line + "  (metrics unavailable)"
    def value(name: str, **labels: str) -> float | None:
        try:
            return sample_value(samples, name, **labels)
        except ValueError:
            return None

    parts = []
    for label, name, scale in (("running", "kvmesh_num_requests_running", 1),
                               ("waiting", "kvmesh_num_requests_waiting", 1),
                               ("kv%", "kvmesh_kv_cache_usage_ratio", 100),
                               ("gen_tokens", "kvmesh_generation_tokens_total", 1)):
        v = value(name)
        parts.append(f"{label}={'-' if v is None else f'{v * scale:.0f}'}")
    # Prompt tokens served from this engine's KV cache: what the router's cache-aware pick earns.
    hits = value("kvmesh_prefix_cache_hits_total", tier="gpu")
    queries = value("kvmesh_prefix_cache_queries_total", tier="gpu")
    parts.append(f"cache_hit%={f'{100 * hits / queries:.0f}' if hits is not None and queries else '-'}")
    return line + "  " + " ".join(parts)


class Supervisor:
    def __init__(self, specs: list[ProcSpec], run_dir: Path, ready_timeout_s: float, grace_s: float = 30.0,
                 out=sys.stdout) -> None:
        self.specs = specs
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.out = out
        self.children: list[Child] = []
        self._stop_signal: int | None = None

    def _say(self, msg: str) -> None:
        print(f"[kvmesh up] {msg}", file=self.out, flush=True)

    def _on_signal(self, sig: int, _frame: object) -> None:
        self._stop_signal = sig

    def _check_alive(self) -> None:
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise UpError(f"{c.spec.name} exited with code {rc}; last lines of {c.log_path}:\n{c.tail()}")

    def _wait_ready(self, child: Child) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while http_status(child.spec.url + "/ready") != 200:
            self._check_alive()
            if self._stop_signal is not None:
                return
            if time.monotonic() > deadline:
                raise UpError(f"{child.spec.name} not ready after {self.ready_timeout_s:.0f}s; last lines of "
                              f"{child.log_path}:\n{child.tail()}")
            time.sleep(0.25)
        child.ready = True
        self._say(status_line(child))

    def _launch(self, spec: ProcSpec) -> Child:
        self._say(f"starting {spec.name}: kvmesh {' '.join(spec.args)}  (log: {self.run_dir}/{spec.name}.log)")
        child = _start(spec, self.run_dir)
        self.children.append(child)
        return child

    def stop(self) -> None:
        """Router first (stops new work), then engines; SIGKILL whatever outlives the grace period."""
        for c in reversed(self.children):
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + self.grace_s
            while c.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.proc.wait(10)

    def start(self) -> None:
        """Start every process and wait until each is ready (engines load their models in
        parallel; the router starts once they all serve). Raises UpError if one dies or times out;
        returns early, with fewer children, if a stop signal arrives meanwhile."""
        engines, router = self.specs[:-1], self.specs[-1]
        for spec in engines:
            self._launch(spec)
        for child in list(self.children):
            if self._stop_signal is None:
                self._wait_ready(child)
        if self._stop_signal is None:
            self._wait_ready(self._launch(router))

    def __enter__(self) -> Supervisor:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, status_interval_s: float) -> int:
        """The foreground loop of `kvmesh up`: start, report, stop on a signal or a death."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            if self._stop_signal is None:
                self._say(f"ready: OpenAI API at {self.specs[-1].url}/v1 (Ctrl-C stops everything)")
            next_status = time.monotonic() + status_interval_s
            while self._stop_signal is None:
                self._check_alive()
                if status_interval_s > 0 and time.monotonic() >= next_status:
                    for c in self.children:
                        self._say(status_line(c))
                    next_status = time.monotonic() + status_interval_s
                time.sleep(0.2)
            self._say(f"{signal.Signals(self._stop_signal).name}: stopping")
            return 0
        except UpError as e:
            self._say(f"error: {e}")
            return 1
        finally:
            self.stop()
            for s, h in previous.items():
                signal.signal(s, h)


def add_up_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up", help="run the local platform: a router in front of N engines on the default model",
        description="Start a cache-aware router and N colocated engines (or N prefill and M decode engines) as "
                    "local processes, print the OpenAI API URL and a status line per process; Ctrl-C or SIGTERM "
                    "stops them all.")
    p.add_argument("--engines", type=int, default=None,
                   help=f"colocated engines (default: {DEFAULT_ENGINES} unless --prefill/--decode are given)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="prefill engines (`kvmesh serve --role prefill`); with --decode, instead of --engines")
    p.add_argument("--decode", type=int, default=0, metavar="M",
                   help="decode engines (`kvmesh serve --role decode`) that receive KV from the prefill engines")
    p.add_argument("--kv-transfer-base-port", type=int, default=8200,
                   help="decode engine j receives KV on this port + j (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address every process binds (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (default: %(default)s)")
    p.add_argument("--engine-base-port", type=int, default=8100,
                   help="engine i listens on this port + i, prefill engines first (default: %(default)s)")
    p.add_argument("--kv-events-base-port", type=int, default=5557,
                   help="engine i publishes KV events on this port + 2i, replay on + 2i + 1 (default: %(default)s)")
    p.add_argument("--model", default="default", help="model for every engine (default: the embedded model)")
    p.add_argument("--policy", default="cache-aware",
                   choices=("cache-aware", "session", "least-load", "round-robin"),
                   help="router policy (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per engine (default: cores / engines)")
    p.add_argument("--kv-cache-bytes", default=None, metavar="SIZE", help="KV budget per engine, e.g. 512MiB")
    p.add_argument("--cache-node", action="store_true",
                   help="also run a `kvmesh cache-node`; every engine writes computed KV through to it and "
                        "reloads from it instead of recomputing")
    p.add_argument("--cache-node-port", type=int, default=8090,
                   help="the cache node's HTTP port; its UCX port is the next one (default: %(default)s)")
    p.add_argument("--cache-node-memory", default="1GiB", metavar="SIZE",
                   help="the cache node's KV capacity (default: %(default)s)")
    p.add_argument("--cpu-kv-bytes", default=None, metavar="SIZE", help="host KV tier per engine, e.g. 2GiB")
    p.add_argument("--admission", default="FirstCome", choices=tuple(fa.ADMISSIONS),
                   help="how every engine admits waiting requests, as an InferenceDeployment's spec.slo.admission: "
                        "FirstCome (arrival order, the default); TTFTFirst (requests that can still meet "
                        "--slo-ttft-ms first); TPOTGated (that, and no admission while the running streams' steps "
                        "near --slo-tpot-ms; for engines past capacity, docs/engine.md)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="the time-to-first-token target TTFTFirst and TPOTGated admit against")
    p.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="the time-per-output-token target; TPOTGated holds admissions while steps average "
                        f"{round(100 * fa.TARGET_FRACTION)}%% of it or more")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every `kvmesh serve` (repeatable, e.g. --serve-arg=--dtype=float32)")
    p.add_argument("--status-interval", type=float, default=30.0, metavar="SECONDS",
                   help="print a status line per process this often (0: only on changes)")
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long a process may take to become ready")
    p.add_argument("--log-dir", default=None, help="where each process logs (default: a new temporary directory)")
    p.add_argument("--no-auth", dest="auth", action="store_false",
                   help="run without the internal token (by default up writes one to <log dir>/auth-token, "
                        "mode 0600, and every process checks it on its admin and internal endpoints)")
    p.add_argument("--api-key-file", action="append", default=[], metavar="PATH",
                   help="client API keys the router requires, one per line (repeatable; default: none, "
                        "the OpenAI endpoints are open)")
    p.add_argument("--isolate-tenants", action="store_true",
                   help="a prefix cache per API key: the router salts each key's requests (needs --api-key-file)")
    p.set_defaults(func=handler)


def options_from_args(args: argparse.Namespace) -> UpOptions:
    """`kvmesh up`'s flags as the plan's options."""
    return UpOptions(engines=args.engines, prefill=args.prefill, decode=args.decode,
                      kv_transfer_base_port=args.kv_transfer_base_port, host=args.host, port=args.port,
                      engine_base_port=args.engine_base_port,
                      kv_events_base_port=args.kv_events_base_port, model=args.model, policy=args.policy,
                      threads=args.threads, kv_cache_bytes=args.kv_cache_bytes, serve_args=tuple(args.serve_arg),
                      cache_node=args.cache_node, cache_node_port=args.cache_node_port,
                      cache_node_memory=args.cache_node_memory, cpu_kv_bytes=args.cpu_kv_bytes,
                      api_key_files=tuple(args.api_key_file), isolate_tenants=args.isolate_tenants,
                      admission=args.admission, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)


def handler(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    run_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvmesh-up-"))
    if args.auth:
        opts = dataclasses.replace(opts, auth_token_file=str(write_token(run_dir)))
    try:
        specs = plan(opts, os.cpu_count() or 1)
    except UpError as e:
        print(f"kvmesh up: {e}", file=sys.stderr)
        return 2
    if args.model == "default":
        # Fetch once here, with one progress display, instead of N engines racing for the lock.
        from kvmesh.engine.model.fetch import ModelFetchError, ensure_default_model

        try:
            ensure_default_model()
        except ModelFetchError as e:
            print(f"kvmesh up: {e}", file=sys.stderr)
            return 1
    return Supervisor(specs, run_dir, args.ready_timeout).run(args.status_interval)
