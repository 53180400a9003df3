"""`kvmesh up --prefill 1 --decode 1` for real: the local disaggregated platform (slow).

Real: the `kvmesh up` command, a prefill and a decode engine (default model, fp32) and the router
it starts, UCX between the engines, the official `openai` client. The expected tokens come from
the offline engine in fp32, which tests/engine/test_parity_hf.py holds equal to HF transformers.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.util.metrics import parse_samples, sample_value
from kvmesh.engine.util.localproc import free_port, free_port_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # kvmesh up with prefill and decode engines: about a minute

QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


def test_up_runs_prefill_and_decode_behind_the_router(tmp_path):
    run_dir = tmp_path
    # `up` takes consecutive ports from each base (engines base, base+1; KV events kv .. kv+3).
    port, base, kv, xfer = free_port(), free_port_run(2), free_port_run(4), free_port()
    while len({*range(base, base + 2), *range(kv, kv + 4), port, xfer}) < 8:
        base, kv = free_port_run(2), free_port_run(4)
    cmd = [sys.executable, "-m", "kvmesh", "up", "--prefill", "1", "--decode", "1", "--port", str(port),
           "--engine-base-port", str(base), "--kv-events-base-port", str(kv), "--kv-transfer-base-port", str(xfer),
           "--status-interval", "0", "--serve-arg=--dtype=float32", "--log-dir", str(run_dir)]
    out = open(run_dir / "up.out", "w+")
    proc = subprocess.Popen(cmd, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while "ready: OpenAI API" not in (run_dir / "up.out").read_text():
            assert proc.poll() is None, (run_dir / "up.out").read_text()
            assert time.monotonic() < deadline, (run_dir / "up.out").read_text()
            time.sleep(0.5)
        from kvmesh.engine.llm import LLM

        offline = LLM(EngineConfig(model="default", dtype="float32"))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=600)
        for i, q in enumerate(QUESTIONS):
            messages = [{"role": "user", "content": q}]
            want = offline.generate([offline.engine.tokenizer.apply_chat_template(messages)],
                                    SamplingParams(max_tokens=16, temperature=0.0))[0].text
            kw = dict(model="default", messages=messages, max_tokens=16, temperature=0)
            if i % 2:
                got = "".join(c.choices[0].delta.content or "" for c in
                              client.chat.completions.create(stream=True, **kw) if c.choices)
            else:
                got = client.chat.completions.create(**kw).choices[0].message.content
            assert got == want
        prefill = parse_samples(httpx.get(f"http://127.0.0.1:{base}/metrics", timeout=10).text)
        assert sample_value(prefill, "kvmesh_kv_handoffs_total", outcome="ok") == len(QUESTIONS)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, (run_dir / "up.out").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
