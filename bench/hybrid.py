"""Hybrid models (Qwen3.5 text): what recurrent-state checkpoints cost and what they save.

(a) Zero-hit throughput with checkpoints off / at the default interval / at every block, on
    unique prompts (no prefix is ever reused), runs interleaved round by round so load drifts
    hit every setting alike. Reports end-to-end tokens/s and the mean forward (step) time.
(b) A multi-turn, agent-like trace (each turn = the previous turn's prompt + its output + a
    short new message): TTFT and prefill tokens computed per turn, checkpoints off vs default.
(c) Reload vs recompute: the TTFT of a prefix + 16 new tokens when the prefix (attention KV and
    the checkpoint at its end) is nowhere (recompute), still on the device (the compute floor),
    in the host tiers (pushed there by a filler prompt), or on a ``kvmesh cache-node`` process
    that another engine wrote it through to (this engine's pools empty). Interleaved per round.
(e) A shared system prompt shorter than the checkpoint interval (``--shared-len``, default 300)
    and several users after it, one at a time: tokens each reuses and its TTFT.

``--before DIR`` runs the default setting also from another checkout (e.g. the previous commit),
its kvmesh package first on PYTHONPATH, in a worker process fed round by round, beside the same
setting of this checkout in a worker of its own: (a) and (e) then compare before and after in one
invocation, interleaved, each in a process holding one engine.

The model is a random Qwen3_5ForCausalLM built by transformers at start (random weights cost
the same as trained ones). Usage:

    .venv/bin/python bench/hybrid.py [--rounds 3] [--prompts 8] [--prompt-len 256] [--out-len 32]
        [--reload-len 1024] [--shared-len 300] [--only zero-hit|reload|shared] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
             max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _id_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` made-up words: the benchmark feeds token ids, and the
    engine only needs a tokenizer in the model directory to load it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
                                   pad_token="w2")


def build_model(root: Path) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**MODEL))
    out = root / "qwen3_5-bench"
    model.save_pretrained(out)
    _id_tokenizer(MODEL["vocab_size"]).save_pretrained(out)
    return out


SETTINGS = {
    "off": dict(state_checkpoint_bytes=0),
    "default": dict(),
    "every-block": dict(state_checkpoint_interval=16),
}


def engine(model_dir: Path, **cfg):
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32",
                                  **{"num_kv_blocks": 4096, "max_num_batched_tokens": 8192, **cfg}))


def timed_forward(eng) -> list[float]:
    """Wrap the runner so each forward's wall time is recorded."""
    times: list[float] = []
    execute = eng.runner.execute

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return execute(*a, **k)
        finally:
            times.append(time.perf_counter() - t0)

    eng.runner.execute = timed
    return times


class Before:
    """One engine setting run from another checkout, in a worker process (``--worker``) that
    generates what it is sent, line by line, so that before and after interleave round by round."""

    def __init__(self, tree: str, model_dir: Path, setting: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", setting, "--model-dir", str(model_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(),
            env=dict(os.environ, PYTHONPATH=tree))

    def generate(self, prompts: list[list[int]], olen: int) -> dict:
        """{"dt": seconds, "steps": forward seconds, "cached": tokens per prompt}."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "olen": olen}) + "\n")
        self.proc.stdin.flush()
        while not (line := self.proc.stdout.readline()).startswith("RESULT "):
            if not line:
                raise RuntimeError(f"the worker of the other checkout exited ({self.proc.wait()})")
        return json.loads(line[len("RESULT "):])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def workers(before: str | None, model_dir: Path) -> dict[str, Before]:
    """With ``--before``: the default setting in a worker process from that checkout and one from
    this one, so that before and after run alike (each its own process, one engine in it)."""
    if not before:
        return {}
    here = str(Path(__file__).resolve().parents[1])
    return {"default, worker": Before(here, model_dir, "default"),
            "default (before)": Before(before, model_dir, "default")}


def local_generate(eng, steps: list[float], prompts: list[list[int]], olen: int) -> dict:
    """What ``Before.generate`` answers, for an engine of this checkout."""
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling import SamplingParams

    steps.clear()
    t0 = time.perf_counter()
    res = LLM(engine=eng).generate(prompts, SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True))
    return {"dt": time.perf_counter() - t0, "steps": list(steps), "cached": [r.num_cached_tokens for r in res]}


def worker(setting: str, model_dir: Path) -> None:
    eng = engine(model_dir, **SETTINGS[setting])
    steps = timed_forward(eng)
    for line in sys.stdin:
        req = json.loads(line)
        print("RESULT " + json.dumps(local_generate(eng, steps, req["prompts"], req["olen"])), flush=True)


_STATE_CALLS = ("hit", "cancel", "allocate", "free", "plan", "commit", "abort", "flush", "take_published")


class StateWork:
    """The checkpoint work inside an engine's steps, timed where it runs so the load on the machine
    cannot hide it the way it hides a 2% difference of end-to-end runs: the state manager's
    bookkeeping (every call, timed), and the state copies a capture makes inside the forward (the
    captures are counted from each step's plan and priced by timing the same copies on the
    engine's own pool, ``copy_s``). Step time is the engine's ``step`` wall time."""

    def __init__(self, eng) -> None:
        self.bookkeeping_s = self.step_s = 0.0
        self.end_captures = self.inner_captures = self.steps = 0
        mgr = eng.state_slots
        for name in _STATE_CALLS:
            setattr(mgr, name, self._timed(getattr(mgr, name), name == "plan"))
        step = eng.step

        def timed_step():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                self.step_s += time.perf_counter() - t0
                self.steps += 1

        eng.step = timed_step
        self.copy_s = self._copy_cost(eng.runner.states)
        self.inner_s = self.copy_s  # plus the scan's share: set by the caller (scan_capture_cost)

    def _timed(self, fn, counts_captures: bool):
        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.bookkeeping_s += time.perf_counter() - t0
            if counts_captures:
                for seq, caps in zip(a[0], out.captures):  # seq: (id, tokens, root, prompt len, start, n)
                    ends = sum(1 for c, _ in caps if c == seq[5])
                    self.end_captures += ends
                    self.inner_captures += len(caps) - ends
            return out
        return timed

    @staticmethod
    def _copy_cost(pool, reps: int = 200) -> float:
        """Seconds for one end-of-chunk capture: every linear layer's conv and ssm state of a slot
        copied into a checkpoint entry, as the forward does it (median of ``reps``)."""
        if pool.ckpt_conv.shape[1] == 0:
            return 0.0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for layer in range(pool.conv.shape[0]):
                pool.ckpt_conv[layer, 0] = pool.conv[layer, 0]
                pool.ckpt_ssm[layer, 0] = pool.ssm[layer, 0]
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    @staticmethod
    def scan_capture_cost(eng, batch: int, tokens: int, reps: int = 30) -> float:
        """Seconds a capture inside a prefill chunk adds to the scan, over every linear layer
        (timed on a ``batch`` x ``tokens`` call of the engine's kernel, one capture per sequence)."""
        from kvmesh.engine.kernels.gated_delta import gated_delta_kernels

        chunked = gated_delta_kernels("torch").chunked
        layers, _, h, dk, dv = eng.runner.states.ssm.shape
        gen = torch.Generator().manual_seed(1)
        q, k = (torch.nn.functional.normalize(torch.randn(batch, h, tokens, dk, generator=gen), dim=-1)
                for _ in range(2))
        v = torch.randn(batch, h, tokens, dv, generator=gen)
        g = -torch.rand(batch, h, tokens, generator=gen)
        beta = torch.rand(batch, h, tokens, generator=gen)
        state = torch.zeros(batch, h, dk, dv)
        caps = [(b, tokens - 16) for b in range(batch)]

        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(reps):  # interleaved, so load drifts hit both alike
            for with_caps in (False, True):
                t0 = time.perf_counter()
                chunked(q, k, v, g, beta, state, capture=caps if with_caps else None)
                times[with_caps].append(time.perf_counter() - t0)
        # The least disturbed call of each.
        extra = max(0.0, min(times[True]) - min(times[False])) / batch
        return layers * extra

    def reset(self) -> None:
        self.bookkeeping_s = self.step_s = 0.0
        self.end_captures = self.inner_captures = self.steps = 0

    def share(self) -> dict[str, float]:
        captures_s = self.end_captures * self.copy_s + self.inner_captures * self.inner_s
        return {"steps": self.steps, "step_ms": 1e3 * self.step_s / max(self.steps, 1),
                "bookkeeping_us": 1e6 * self.bookkeeping_s / max(self.steps, 1),
                "end_captures": self.end_captures, "inner_captures": self.inner_captures,
                "copy_us": 1e6 * self.copy_s, "inner_us": 1e6 * self.inner_s,
                "share": (self.bookkeeping_s + captures_s) / self.step_s if self.step_s else 0.0}


def zero_hit(model_dir: Path, rounds: int, n: int, plen: int, olen: int,
             before: str | None = None) -> dict[str, dict[str, float]]:
    engines = {name: engine(model_dir, **cfg) for name, cfg in SETTINGS.items()}
    steps = {name: timed_forward(e) for name, e in engines.items()}
    work = {name: StateWork(e) for name, e in engines.items()}
    scan_s = StateWork.scan_capture_cost(engines["off"], n, plen)
    for w in work.values():
        w.inner_s = w.copy_s + scan_s
    gen = torch.Generator().manual_seed(123)
    runs = {name: (lambda ps, e=e, st=steps[name]: local_generate(e, st, ps, olen)) for name, e in engines.items()}
    others = workers(before, model_dir)
    for name, w in others.items():
        runs[name] = lambda ps, w=w: w.generate(ps, olen)
    tput: dict[str, list[float]] = {name: [] for name in runs}
    prefill_ms: dict[str, list[float]] = {name: [] for name in runs}
    decode_ms: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds + 1):  # round 0 warms up
        if r == 1:
            for w in work.values():
                w.reset()
        # New unique prompts every round (and the same ones for every setting): zero hits.
        prompts = [torch.randint(3, MODEL["vocab_size"], (plen,), generator=gen).tolist() for _ in range(n)]
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            got = runs[name](prompts)
            if r:
                tput[name].append(n * (plen + olen) / got["dt"])
                # The first step prefills every prompt (budget >= n * plen); the rest decode.
                prefill_ms[name].append(1e3 * got["steps"][0])
                decode_ms[name].append(1e3 * statistics.median(got["steps"][1:]))
    for w in others.values():
        w.close()
    out = {}
    for name in runs:
        e = engines.get(name)
        st = e.stats() if e is not None else None
        # Minimum over rounds: the least disturbed run of each, robust to other load on the machine.
        out[name] = {"tok_s": statistics.median(tput[name]), "prefill_ms": min(prefill_ms[name]),
                     "decode_ms": min(decode_ms[name]),
                     # None: another checkout's worker (not counted); 0: checkpoints off.
                     "checkpoints_saved": None if st is None else st.state_checkpoints.saves if st.state_checkpoints else 0,
                     **(work[name].share() if e is not None else {})}
    return out


def shared_prefix(model_dir: Path, rounds: int, shared: int, users: int, before: str | None) -> dict[str, list]:
    """(e) Per runner, per user i (in arrival order): (median TTFT ms, median tokens reused) over
    ``rounds``: every round a new ``shared``-token system prompt, then ``users`` prompts each
    adding 20 + 7 i tokens of its own, one at a time, ``max_tokens=1``."""
    eng = engine(model_dir)
    steps = timed_forward(eng)
    runs = {"default": lambda ps: local_generate(eng, steps, ps, 1)}
    others = workers(before, model_dir)
    for name, w in others.items():
        runs[name] = lambda ps, w=w: w.generate(ps, 1)
    gen = torch.Generator().manual_seed(321)
    ttft: dict[str, list[list[float]]] = {name: [[] for _ in range(users)] for name in runs}
    reused: dict[str, list[list[int]]] = {name: [[] for _ in range(users)] for name in runs}
    for r in range(rounds + 1):  # round 0 warms up
        system = torch.randint(3, MODEL["vocab_size"], (shared,), generator=gen).tolist()
        prompts = [system + torch.randint(3, MODEL["vocab_size"], (20 + 7 * i,), generator=gen).tolist()
                   for i in range(users)]
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            for i, p in enumerate(prompts):
                got = runs[name]([p])
                if r:
                    ttft[name][i].append(1e3 * got["dt"])
                    reused[name][i].append(got["cached"][0])
    for w in others.values():
        w.close()
    return {name: [(statistics.median(ttft[name][i]), statistics.median(reused[name][i])) for i in range(users)]
            for name in runs}


def multi_turn(model_dir: Path, turns: int, first_len: int, msg_len: int, olen: int) -> dict[str, list[tuple]]:
    """Per setting, per turn: (TTFT ms, prompt tokens, prefill tokens computed)."""
    from kvmesh.engine.sampling import SamplingParams

    out: dict[str, list[tuple]] = {}
    for name in ("off", "default"):
        eng = engine(model_dir, **SETTINGS[name])
        gen = torch.Generator().manual_seed(7)
        history = torch.randint(3, MODEL["vocab_size"], (first_len,), generator=gen).tolist()
        rows = []
        for t in range(turns):
            rid = f"turn{t}"
            t0 = time.perf_counter()
            eng.add_request(rid, history, SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True))
            ttft, toks, cached = None, [], 0
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if ttft is None and o.new_token_ids:
                        ttft = time.perf_counter() - t0
                    toks.extend(o.new_token_ids)
                    cached = o.num_cached_tokens
            rows.append((round(1e3 * ttft, 1), len(history), len(history) - cached))
            history = history + toks + torch.randint(3, MODEL["vocab_size"], (msg_len,), generator=gen).tolist()
        out[name] = rows
    return out


def reload(model_dir: Path, plen: int, rounds: int) -> dict[str, dict[str, float]]:
    """(c) Per setting: median TTFT ms over ``rounds``, tokens reported cached, prefix bytes moved."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from kv_tiers import start_node, wait_written

    from kvmesh.engine.llm import LLM
    from kvmesh.engine.model.recurrent_state import StatePool
    from kvmesh.engine.model.safetensors_loader import read_hf_config
    from kvmesh.engine.sampling import SamplingParams
    from kvmesh.engine.transfer.ucx_env import apply_ucx_defaults

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    apply_ucx_defaults()
    per = StatePool.bytes_per_slot(read_hf_config(model_dir), 4)
    blocks = plen // 16 + 2
    proc, port = start_node("1GiB")
    node = dict(cache_node=f"127.0.0.1:{port}", cache_node_timeout=60.0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        res = llm.generate([prompt], one)[0]
        return time.perf_counter() - t0, res.num_cached_tokens

    def ready(llm: LLM) -> LLM:
        """Warmed up: one unrelated short prompt first (first-call costs, and for an engine with a
        cache node its connections, which a serving engine has long set up)."""
        while llm.engine._cache_node is not None and llm.engine._cache_node.clients() is None:
            time.sleep(0.05)
        llm.generate([torch.randint(3, MODEL["vocab_size"], (40,)).tolist()], one)
        return llm

    times: dict[str, list[float]] = {k: [] for k in ("recompute", "device hit", "host reload", "node reload")}
    cached: dict[str, int] = {}
    kv_bytes = 0
    try:
        for r in range(rounds):
            gen = torch.Generator().manual_seed(100 + r)
            prefix, filler, new = (torch.randint(3, MODEL["vocab_size"], (n,), generator=gen).tolist()
                                   for n in (plen, plen, 16))
            prompt = prefix + new
            cold = ready(LLM(engine=engine(model_dir)))
            t, c = ttft(cold, prompt)
            times["recompute"].append(t), cached.setdefault("recompute", c)
            warm = ready(LLM(engine=engine(model_dir)))
            warm.generate([prefix], one)
            t, c = ttft(warm, prompt)
            times["device hit"].append(t), cached.setdefault("device hit", c)
            host = ready(LLM(engine=engine(model_dir, num_kv_blocks=blocks, state_checkpoint_bytes=2 * per,
                                           cpu_kv_bytes=2 * blocks * (1 << 20), cpu_state_bytes=8 * per)))
            host.generate([prefix], one)
            host.generate([filler], one)  # pushes the prefix's blocks and checkpoint to the host tiers
            t, c = ttft(host, prompt)
            times["host reload"].append(t), cached.setdefault("host reload", c)
            kv = host.engine.runner.kv_cache
            kv_bytes = c * kv[:, :, 0, 0].numel() * kv.element_size()
            writer = ready(LLM(engine=engine(model_dir, **node)))
            writer.generate([prefix], one)
            wait_written(writer, plen // 16 - 1)
            remote = writer.engine.tiers.remote
            while remote.inflight_bytes or remote.state_stats.stored < 1:
                time.sleep(0.05)
            writer.engine.close()
            reader = ready(LLM(engine=engine(model_dir, **node)))
            t, c = ttft(reader, prompt)
            times["node reload"].append(t), cached.setdefault("node reload", c)
            while reader.engine.tiers.remote.inflight_bytes:  # its own write-through ends before close
                time.sleep(0.05)
            reader.engine.close()
    finally:
        proc.terminate()
        proc.wait(15)
    return {k: {"ttft_ms": 1e3 * statistics.median(v), "cached": cached[k], "kv_bytes": kv_bytes, "state_bytes": per}
            for k, v in times.items()}


def cpu_name() -> str:
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx512", "amx", "avx2"))]
    return f"{fields.get('Model name', '?').strip()} ({fields.get('CPU(s)', '?').strip()} CPUs; {' '.join(flags)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reload-len", type=int, default=1024)
    ap.add_argument("--shared-len", type=int, default=300, help="(e): the shared system prompt's tokens")
    ap.add_argument("--users", type=int, default=4, help="(e): prompts after the shared one")
    ap.add_argument("--only", choices=("zero-hit", "reload", "shared"), help="run only part (a), (c) or (e)")
    ap.add_argument("--before", metavar="DIR", help="also run the default setting from this checkout")
    ap.add_argument("--worker", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, Path(args.model_dir))
        return
    print("CPU:", cpu_name(), "| torch threads:", torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        print(f"model: random Qwen3.5 text, {MODEL['num_hidden_layers']} layers (3:1 DeltaNet:attention), hidden "
              f"{MODEL['hidden_size']}, fp32")
        if args.only == "reload":
            print_reload(reload(model_dir, args.reload_len, args.rounds), args)
            return
        if args.only == "shared":
            print_shared(shared_prefix(model_dir, args.rounds, args.shared_len, args.users, args.before), args)
            return
        res = zero_hit(model_dir, args.rounds, args.prompts, args.prompt_len, args.out_len, args.before)
        base = res["off"]
        print(f"\n(a) zero-hit: {args.prompts} prompts x {args.prompt_len} tokens, {args.out_len} out, "
              f"median of {args.rounds} interleaved rounds")
        print(f"{'setting':<17} {'tok/s':>8} {'vs off':>7} {'prefill ms':>10} {'vs off':>7} {'decode ms':>9} "
              f"{'vs off':>7} {'saved':>6}")
        for name, r in res.items():
            print(f"{name:<17} {r['tok_s']:8.1f} {r['tok_s'] / base['tok_s']:7.3f} {r['prefill_ms']:10.1f} "
                  f"{r['prefill_ms'] / base['prefill_ms']:7.3f} {r['decode_ms']:9.2f} "
                  f"{r['decode_ms'] / base['decode_ms']:7.3f} {'-' if r['checkpoints_saved'] is None else r['checkpoints_saved']:>6}")
        print("\nstep-time share of the state work (timed in the steps themselves; captures priced by "
              "timing the same copies)")
        print(f"{'setting':<17} {'steps':>6} {'step ms':>8} {'state calls us/step':>19} {'end captures':>12} "
              f"{'copy us':>8} {'inner captures':>14} {'inner us':>8} {'share %':>8}")
        for name, r in res.items():
            if "steps" not in r:
                continue  # another checkout's worker: not instrumented
            print(f"{name:<17} {r['steps']:6d} {r['step_ms']:8.2f} {r['bookkeeping_us']:19.1f} "
                  f"{r['end_captures']:12d} {r['copy_us']:8.1f} {r['inner_captures']:14d} {r['inner_us']:8.1f} {100 * r['share']:8.3f}")
        if args.only == "zero-hit":
            return
        mt = multi_turn(model_dir, args.turns, args.prompt_len, 16, args.out_len)
        print(f"\n(b) multi-turn: first prompt {args.prompt_len} tokens, +{args.out_len} out +16 new per turn")
        print(f"{'turn':<5} {'prompt':>7} | {'off: TTFT ms':>12} {'computed':>9} | {'default: TTFT ms':>16} {'computed':>9}")
        for t, (a, b) in enumerate(zip(mt["off"], mt["default"])):
            print(f"{t:<5} {a[1]:>7} | {a[0]:>12} {a[2]:>9} | {b[0]:>16} {b[2]:>9}")
        print_reload(reload(model_dir, args.reload_len, args.rounds), args)
        print_shared(shared_prefix(model_dir, args.rounds, args.shared_len, args.users, args.before), args)


def print_shared(res: dict[str, list], args: argparse.Namespace) -> None:
    print(f"\n(e) a {args.shared_len}-token shared system prompt, then {args.users} users (20 + 7 i tokens each), "
          f"one at a time, max_tokens=1; median of {args.rounds} rounds")
    names = list(res)
    print(f"{'user':<5} " + " | ".join(f"{n + ': TTFT ms':>24} {'reused':>7}" for n in names))
    for i in range(args.users):
        print(f"{i:<5} " + " | ".join(f"{res[n][i][0]:24.1f} {res[n][i][1]:7.0f}" for n in names))


def print_reload(res: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    any_row = next(iter(res.values()))
    print(f"\n(c) reload vs recompute: a {args.reload_len}-token prefix + 16 new tokens, max_tokens=1, median of "
          f"{args.rounds} interleaved rounds; prefix KV {any_row['kv_bytes'] / 1e6:.1f} MB + checkpoint "
          f"{any_row['state_bytes'] / 1e6:.2f} MB")
    base = res["recompute"]["ttft_ms"]
    print(f"{'prefix is':<12} {'TTFT ms':>8} {'vs recompute':>12} {'cached':>7}")
    for name, r in res.items():
        print(f"{name:<17} {r['ttft_ms']:8.1f} {r['ttft_ms'] / base:12.3f} {r['cached']:7d}")


if __name__ == "__main__":
    main()
