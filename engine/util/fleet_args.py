"""The command line of each fleet role, from what it must know: one renderer for both places that
start a fleet (`kvmesh up` on this machine, the operator's pods), with one flag vocabulary.

Pure: a role's settings in, `kvmesh` arguments out (without the program). Every line is parsed by
the real CLI in the tests (tests/util/test_rendered_command_lines.py, tests/up/test_up.py), so a
flag renamed in a parser and not here fails there.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.tpot_gate import TARGET_FRACTION

ADMISSIONS = {"FirstCome": (), "TTFTFirst": ("ttft",), "TPOTGated": ("ttft", "tpot")}
"""How engines admit waiting requests against an SLO, and the targets each needs: in arrival order;
those that can still meet the TTFT target first (`kvmesh serve --ttft-slo-ms`); or that, and no
admission while the streams' steps near the TPOT target (`--admission-tpot-ms` at
``TARGET_FRACTION`` of it). The operator's ``spec.slo.admission`` and `kvmesh up --admission` name
them alike."""


class AdmissionError(ValueError):
    """An unknown admission, or one without the targets it admits against (``missing``)."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


def missing_targets(admission: str, ttft_ms: object | None, tpot_ms: object | None) -> tuple[str, ...]:
    """The targets ("ttft", "tpot") ``admission`` admits against that are None; AdmissionError for
    an unknown admission."""
    if admission not in ADMISSIONS:
        raise AdmissionError(f"unknown admission {admission!r}: one of {', '.join(ADMISSIONS)}")
    given = {"ttft": ttft_ms, "tpot": tpot_ms}
    return tuple(t for t in ADMISSIONS[admission] if given[t] is None)


def admission_fields(admission: str, ttft_ms: float | None, tpot_ms: float | None) -> dict[str, float]:
    """`EngineLine` fields for ``admission`` at the SLO's targets (ms); {} for FirstCome.

    Raises AdmissionError whose ``missing`` names the absent targets, for each caller to say in
    its own vocabulary (CR fields, CLI flags)."""
    missing = missing_targets(admission, ttft_ms, tpot_ms)
    if missing:
        raise AdmissionError(f"admission {admission} admits against the {' and '.join(missing)} target", missing)
    fields: dict[str, float] = {}
    if ttft_ms is not None and "ttft" in ADMISSIONS[admission]:
        fields["ttft_slo_ms"] = float(ttft_ms)
    if tpot_ms is not None and "tpot" in ADMISSIONS[admission]:
        fields["admission_tpot_ms"] = TARGET_FRACTION * float(tpot_ms)
    return fields


@dataclass(frozen=True)
class EngineLine:
    """`kvmesh serve`. None leaves a flag out (the engine's default)."""

    role: str = "both"
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    model_path: str | None = None
    model_uri: str | None = None
    model_format: str | None = None  # "gguf" or "safetensors"
    dtype: str | None = None
    cache_node: str | None = None  # HOST:PORT of a cache node (or a headless Service of them)
    cpu_kv_bytes: str | None = None
    kv_cache_bytes: str | None = None
    num_threads: int | None = None
    kv_events_port: int | None = None
    kv_transfer_port: int | None = None  # decode role
    drain_timeout_s: int | None = None
    state_checkpoint_interval: int | None = None  # hybrid models' recurrent-state checkpoints
    state_checkpoint_bytes: int | None = None
    ttft_slo_ms: float | None = None  # TTFT-first admission (engine/scheduler.py)
    admission_tpot_ms: float | None = None  # the TPOT gate (engine/tpot_gate.py)
    config: str | None = None
    auth_token_file: str | None = None  # the deployment's internal token (a file: never on a command line)
    api_key_files: tuple[str, ...] = ()  # client keys, where clients reach the engine directly (a gateway)
    extra: tuple[str, ...] = ()  # appended as given (`kvmesh up --serve-arg`)


@dataclass(frozen=True)
class Pool:
    """Where a router finds a pool's engines: fixed base URLs, or a headless Service (HOST:PORT)
    whose DNS name resolves to one address per ready pod."""

    urls: tuple[str, ...] = ()
    service: str | None = None


@dataclass(frozen=True)
class RouterLine:
    """`kvmesh router`; ``prefill`` turns on two-stage (prefill/decode) serving."""

    decode: Pool
    prefill: Pool | None = None
    policy: str = "cache-aware"
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    cache_node: str | None = None
    config: str | None = None
    auth_token_file: str | None = None
    api_key_files: tuple[str, ...] = ()
    isolate_tenants: bool = False
    ext_proc_port: int | None = None  # also serve Envoy's ext_proc (the endpoint picker of a gateway)


@dataclass(frozen=True)
class CacheNodeLine:
    """`kvmesh cache-node`: HTTP on ``port``, block transfers (UCX) on ``ucx_port``."""

    memory: str
    host: str = "127.0.0.1"
    port: int = 8000
    ucx_port: int = 8001
    config: str | None = None
    auth_token_file: str | None = None


def _opt(flag: str, value: object | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def serve_args(e: EngineLine) -> list[str]:
    return ["serve", "--role", e.role, "--model", e.model,
            *_opt("--model-path", e.model_path), *_opt("--model-uri", e.model_uri),
            *_opt("--model-format", e.model_format), *_opt("--dtype", e.dtype),
            *_opt("--cache-node", e.cache_node), *_opt("--cpu-kv-bytes", e.cpu_kv_bytes),
            *_opt("--kv-cache-bytes", e.kv_cache_bytes), *_opt("--num-threads", e.num_threads),
            *_opt("--kv-events-port", e.kv_events_port), *_opt("--kv-transfer-port", e.kv_transfer_port),
            *_opt("--drain-timeout", e.drain_timeout_s),
            *_opt("--state-checkpoint-interval", e.state_checkpoint_interval),
            *_opt("--state-checkpoint-bytes", e.state_checkpoint_bytes),
            *_opt("--ttft-slo-ms", e.ttft_slo_ms), *_opt("--admission-tpot-ms", e.admission_tpot_ms),
            "--host", e.host, "--port", str(e.port), *_opt("--config", e.config),
            *_opt("--auth-token-file", e.auth_token_file),
            *(a for f in e.api_key_files for a in ("--api-key-file", f)), *e.extra]


def _pool(p: Pool, urls_flag: str, service_flag: str) -> list[str]:
    if bool(p.urls) == bool(p.service):
        raise ValueError(f"a pool is either engine URLs or a Service, not {p}")
    return [urls_flag, ",".join(p.urls)] if p.urls else [service_flag, str(p.service)]


def router_args(r: RouterLine) -> list[str]:
    return ["router", "--policy", r.policy, "--model", r.model,
            *(_pool(r.prefill, "--prefill-engines", "--prefill-service") if r.prefill else []),
            *_pool(r.decode, "--engines", "--decode-service"), *_opt("--cache-node", r.cache_node),
            "--host", r.host, "--port", str(r.port), *_opt("--config", r.config),
            *_opt("--auth-token-file", r.auth_token_file),
            *(a for f in r.api_key_files for a in ("--api-key-file", f)),
            *(["--isolate-tenants"] if r.isolate_tenants else []), *_opt("--ext-proc-port", r.ext_proc_port)]


def cache_node_args(c: CacheNodeLine) -> list[str]:
    return ["cache-node", "--memory", c.memory, "--ucx-port", str(c.ucx_port),
            "--host", c.host, "--port", str(c.port), *_opt("--config", c.config),
            *_opt("--auth-token-file", c.auth_token_file)]
