"""`kvmesh up` for real: two engines on the embedded model behind the router, driven by the
official `openai` client, then stopped by SIGTERM.

Real: the `kvmesh up` command, both engines (default model, fp32), their KV event streams, the
router and its cache-aware policy, the HTTP between them. The expected tokens come from the
offline engine in fp32, which tests/engine/test_parity_hf.py holds equal to HF transformers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sampling import SamplingParams

from kvmesh.engine.util.localproc import free_port, free_port_run
from tests.support.readme import readme_block

pytestmark = pytest.mark.slow  # kvmesh up: a router and two engines on the default model

QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kvmesh-up-test")
    port, base, kv = free_port(), free_port_run(2), free_port_run(4)
    while len({*range(base, base + 2), *range(kv, kv + 4), port}) < 7:  # engines base, base+1; kv .. kv+3
        base, kv = free_port_run(2), free_port_run(4)
    cmd = [sys.executable, "-m", "kvmesh", "up", "--engines", "2", "--port", str(port),
           "--engine-base-port", str(base), "--kv-events-base-port", str(kv), "--status-interval", "0",
           "--serve-arg=--dtype=float32", "--log-dir", str(run_dir)]
    out = open(run_dir / "up.out", "w+")
    proc = subprocess.Popen(cmd, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while "ready: OpenAI API" not in (run_dir / "up.out").read_text():
        assert proc.poll() is None, (run_dir / "up.out").read_text()
        assert time.monotonic() < deadline, (run_dir / "up.out").read_text()
        time.sleep(0.5)
    yield proc, f"http://127.0.0.1:{port}", run_dir
    if proc.poll() is None:
        proc.kill()
    out.close()


@pytest.fixture(scope="module")
def offline():
    from kvmesh.engine.llm import LLM

    return LLM(EngineConfig(model="default", dtype="float32"))


def test_chat_through_the_router_matches_the_offline_engine(platform, offline) -> None:
    _proc, url, _ = platform
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    tok = offline.engine.tokenizer
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        want = offline.generate([tok.apply_chat_template(messages)],
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
        got = client.chat.completions.create(model="default", messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0)
        assert got.choices[0].message.content == want.text


def test_a_repeated_long_prompt_goes_to_the_engine_that_cached_it(platform) -> None:
    """A prompt long enough that its cached blocks outweigh any load difference between the two
    engines (the policy's score, docs/router.md) is routed back to the engine holding it."""
    _proc, url, _ = platform
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    system = "You answer questions about a fleet of language model engines and their caches. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is a KV block?"}]
    first = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
    time.sleep(1.0)  # the engine's KV events reach the router's index asynchronously
    again = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 160
    assert again.usage.prompt_tokens_details.cached_tokens >= 160


def test_the_readmes_curl_and_openai_calls_answer(platform, offline) -> None:
    """The README's curl and openai-client snippets, run as written, on `kvmesh up`'s port."""
    import json

    _proc, url, _ = platform
    curl = readme_block("bash", "curl ").replace("http://127.0.0.1:8000", url)
    got = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=600, check=True)
    body = json.loads(got.stdout)
    question = [{"role": "user", "content": "What is a KV cache?"}]
    want = offline.generate([offline.engine.tokenizer.apply_chat_template(question)],
                            SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert body["choices"][0]["message"]["content"] == want.text, body
    snippet = readme_block("python", "from openai import OpenAI").replace("http://127.0.0.1:8000", url)
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=600,
                         check=True).stdout.strip()
    text, cached = out.rsplit(" ", 1)
    assert text == want.text.strip() and int(cached) >= 0, out


def test_sigterm_stops_every_process_and_exits_zero(platform) -> None:
    proc, _url, run_dir = platform
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, (run_dir / "up.out").read_text()
    text = (run_dir / "up.out").read_text()
    pids = [int(line.split("pid")[1].split()[0]) for line in text.splitlines() if " pid " in line]
    assert len(pids) == 3, text
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
