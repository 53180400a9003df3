"""`kvmesh up --model DIR` on a hybrid (Qwen3.5 text) model: an engine and the cache-aware router,
driven by the official `openai` client, a second turn resuming from a state checkpoint.

Real: the `kvmesh up` command, the engine and router processes, the tiny random
Qwen3_5ForCausalLM transformers wrote. Expected outputs come from the offline engine in fp32, which
tests/engine/test_hybrid_parity.py holds equal to transformers token for token.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.util.localproc import free_port, free_port_run
from tests.support.tiny_hybrid import make_tiny_hybrid_model

pytestmark = pytest.mark.slow  # three processes and a model load: about half a minute

SERVE = ("--dtype=float32", "--block-size=4", "--num-kv-blocks=512", "--state-checkpoint-interval=16")
TURN1 = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


def test_up_serves_a_hybrid_model_and_a_second_turn_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    from kvmesh.engine.llm import LLM

    model = make_tiny_hybrid_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port, base, kv = free_port(), free_port_run(1), free_port_run(2)
    cmd = [sys.executable, "-m", "kvmesh", "up", "--engines", "1", "--model", str(model), "--port", str(port),
           "--engine-base-port", str(base), "--kv-events-base-port", str(kv), "--status-interval", "0",
           *(f"--serve-arg={a}" for a in SERVE), "--log-dir", str(run_dir)]
    with open(run_dir / "up.out", "w+") as out:
        proc = subprocess.Popen(cmd, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while "ready: OpenAI API" not in (run_dir / "up.out").read_text():
                assert proc.poll() is None, (run_dir / "up.out").read_text()
                assert time.monotonic() < deadline, (run_dir / "up.out").read_text()
                time.sleep(0.5)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=300)
            offline = LLM(EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=512,
                                       state_checkpoint_interval=16))
            params = SamplingParams(max_tokens=12, temperature=0.0)
            r1 = client.chat.completions.create(model=str(model), messages=TURN1, temperature=0, max_tokens=12)
            assert r1.choices[0].message.content == offline.chat([TURN1], params)[0].text
            turn2 = TURN1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                             {"role": "user", "content": "Paris is the capital of France."}]
            r2 = client.chat.completions.create(model=str(model), messages=turn2, temperature=0, max_tokens=12)
            assert r2.choices[0].message.content == offline.chat([turn2], params)[0].text
            assert r2.usage.prompt_tokens_details.cached_tokens > 0
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0, (run_dir / "up.out").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
