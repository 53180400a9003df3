"""`ServeSettings`: everything `kvmesh serve` needs besides the engine's own settings.

Each field with a command-line option declares it (engine/util/setting.py), so the flag, its
default and the setting are one definition. Imported when the `kvmesh` parser is built:
nothing heavy here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvmesh.engine.api.auth import Credentials
from kvmesh.engine.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from kvmesh.engine.config import SERVER, EngineConfig
from kvmesh.engine.kv.event_wire import EVENT_FORMATS, KVMESH_FORMAT
from kvmesh.engine.roles import ROLES
from kvmesh.engine.util.cliargs import non_negative_int, port_or_zero
from kvmesh.engine.util.setting import setting


def kv_events_port(text: str) -> int:
    return port_or_zero(text, 65534, "a KV events port (the replay socket takes the next one)", "off")


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class ServeSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = setting("127.0.0.1", "--host", group=SERVER, help="address to bind (0.0.0.0 in containers)")
    port: int = setting(8000, "--port", group=SERVER, type=int, help="HTTP port (default: %(default)s)")
    served_model_names: list[str] = field(default_factory=list)
    max_waiting_requests: int = setting(
        1024, "--max-waiting-requests", group=SERVER, type=int,
        help="sequences that may wait for their first token before new requests get 429 (0: unbounded; "
             "default: %(default)s)")
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # --max-request-bytes, shared with the router (cliargs)
    auth: Credentials = field(default_factory=Credentials)  # --auth-token-file, --api-key(-file) (api/auth.py)
    drain_timeout_s: float = setting(
        30.0, "--drain-timeout", group=SERVER, type=float, metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may run before they are aborted (default: %(default)s)")
    log_level: str = setting("info", "--log-level", group=SERVER, choices=LOG_LEVELS,
                             help="(default: %(default)s)")
    access_log: bool = setting(False, "--access-log", group=SERVER, action="store_true",
                               help="log every HTTP request")
    timeout_keep_alive_s: int = 5
    kv_events_port: int = setting(
        0, "--kv-events-port", group=SERVER, type=kv_events_port, metavar="PORT",
        help="publish KV cache events (ZeroMQ PUB, vLLM's layout) on PORT and answer replay requests on "
             "PORT+1; 0 turns them off (default: %(default)s; the operator uses 5557)")
    kv_events_host: str = "127.0.0.1"  # --kv-events-host, default --host (server/cli.py)
    kv_events_token_ids: bool = setting(
        False, "--kv-events-token-ids", group=SERVER, action="store_true",
        help="put token ids in BlockStored events (external indexers that rebuild hashes from tokens need "
             "them; they reveal every prompt and completion to subscribers; default: off, hashes only)")
    kv_events_format: str = setting(
        KVMESH_FORMAT, "--kv-events-format", group=SERVER, choices=EVENT_FORMATS,
        help="topic layout of the KV event stream: kvmesh (kv-events/<engine id>) or llm-d "
             "(kv@<pod>@<model>, what llm-d's precise prefix-cache indexer subscribes to; it needs "
             "--kv-events-token-ids) (default: %(default)s)")
    kv_events_pod: str = ""  # --kv-events-pod (server/cli.py: default $POD_IP, else the engine id)
    role: str = setting(
        "both", "--role", group=SERVER, choices=ROLES,
        help="both: prefill and decode in this engine (default); prefill: compute prompts and hand their KV "
             "and first token to a decode engine; decode: generate from KV it receives (plain requests are "
             "served colocated). See docs/disagg.md")
    kv_transfer_port: int = setting(
        0, "--kv-transfer-port", group=SERVER, type=port_or_zero, metavar="PORT",
        help="decode role: UCX port that receives KV from prefill engines (0: any free port, reported by "
             "/kv/info; the operator uses 8001)")
    kv_transfer_overlap: bool = setting(
        True, "--kv-transfer-overlap", group=SERVER, action=argparse.BooleanOptionalAction,
        help="prefill role: push each prompt block to the decode engine as soon as its chunk is computed, "
             "overlapping the transfer with later chunks (default: on)")
    kv_transfer_tail_tokens: int = setting(
        128, "--kv-transfer-tail-tokens", group=SERVER, type=non_negative_int, metavar="TOKENS",
        help="prefill role with --kv-transfer-overlap: cut a prompt's last chunk to fewer than TOKENS + one "
             "block, so the blocks before it are pushed while it is computed and only the tail is left to "
             "push after the first token (0: chunks as the token budget cuts them) (default: %(default)s)")
