"""`kvmesh up --prefill 1 --decode 1 --model DIR` on a hybrid (Qwen3.5 text) model (slow).

Real: the `kvmesh up` command, a prefill and a decode engine on the tiny random
Qwen3_5ForCausalLM transformers wrote, the router, UCX between the engines (the recurrent state
at the prompt's end travels with the KV), the official `openai` client. Expected outputs come
from the offline engine in fp32, which tests/engine/test_hybrid_parity.py holds equal to
transformers token for token; a decode engine that lost or ignored the state differs from it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.util.localproc import free_port, free_port_run
from kvmesh.engine.util.metrics import parse_samples, sample_value
from tests.support.tiny_hybrid import make_tiny_hybrid_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # kvmesh up disaggregating a hybrid model

SERVE = ("--dtype=float32", "--block-size=4", "--num-kv-blocks=512", "--state-checkpoint-interval=16")
QUESTIONS = ["The quick brown fox jumps over the lazy dog.", "Name three primary colors, please."]


def test_up_disaggregates_a_hybrid_model(tmp_path: Path) -> None:
    from kvmesh.engine.llm import LLM

    model = make_tiny_hybrid_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port, base, kv, xfer = free_port(), free_port_run(2), free_port_run(4), free_port()
    while len({*range(base, base + 2), *range(kv, kv + 4), port, xfer}) < 8:
        base, kv = free_port_run(2), free_port_run(4)
    cmd = [sys.executable, "-m", "kvmesh", "up", "--prefill", "1", "--decode", "1", "--model", str(model),
           "--port", str(port), "--engine-base-port", str(base), "--kv-events-base-port", str(kv),
           "--kv-transfer-base-port", str(xfer), "--status-interval", "0",
           *(f"--serve-arg={a}" for a in SERVE), "--log-dir", str(run_dir)]
    with open(run_dir / "up.out", "w+") as out:
        proc = subprocess.Popen(cmd, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while "ready: OpenAI API" not in (run_dir / "up.out").read_text():
                assert proc.poll() is None, (run_dir / "up.out").read_text()
                assert time.monotonic() < deadline, (run_dir / "up.out").read_text()
                time.sleep(0.5)
            offline = LLM(EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=512,
                                       state_checkpoint_interval=16))
            params = SamplingParams(max_tokens=12, temperature=0.0)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=300)
            for i, q in enumerate(QUESTIONS):
                messages = [{"role": "user", "content": q}]
                want = offline.chat([messages], params)[0].text
                kw = dict(model=str(model), messages=messages, max_tokens=12, temperature=0)
                if i % 2:
                    got = "".join(c.choices[0].delta.content or "" for c in
                                  client.chat.completions.create(stream=True, **kw) if c.choices)
                else:
                    got = client.chat.completions.create(**kw).choices[0].message.content
                assert got == want, f"question {i}"
            prefill = parse_samples(httpx.get(f"http://127.0.0.1:{base}/metrics", timeout=10).text)
            assert sample_value(prefill, "kvmesh_kv_handoffs_total", outcome="ok") == len(QUESTIONS)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0, (run_dir / "up.out").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
