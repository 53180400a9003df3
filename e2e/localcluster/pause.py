"""The pod sandbox ("pause") image, built from images/pause/pause.c.

No registry is reachable, so the image containerd needs for every pod sandbox
is made here: the C source compiled statically (cached by the source's hash),
packed into a one-layer image archive in the layout `docker save` writes,
which `ctr images import` reads. Packing is a pure function of the binary.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "images" / "pause" / "pause.c"
IMAGE = "kvmesh.local/pause:1"


class PauseError(RuntimeError):
    """The pause binary could not be compiled."""


def _tar(members: list[tuple[str, bytes, int]]) -> bytes:
    """A deterministic tar (fixed owner and mtime) of (name, data, mode) files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def image_archive(binary: bytes, tag: str = IMAGE) -> bytes:
    """A docker-save archive: one layer holding /pause, which is the entrypoint."""
    layer = _tar([("pause", binary, 0o755)])
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }, sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id.split(":", 1)[1] + "/layer.tar"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag],
                            "Layers": [layer_name]}]).encode()
    return _tar([(config_name, config, 0o644), (layer_name, layer, 0o644),
                 ("manifest.json", manifest, 0o644)])


def build_binary(cache_dir: Path) -> Path:
    """Compile pause.c once per source version; return the cached binary."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = cache_dir / "pause" / digest / "pause"
    if out.exists():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise PauseError("no C compiler to build the pause binary; install gcc (Debian: gcc, libc6-dev)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    result = subprocess.run([cc, "-Os", "-static", "-o", str(tmp), str(SOURCE)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise PauseError(f"{cc} could not build {SOURCE} (static glibc comes with libc6-dev):\n"
                         f"{result.stderr[-1500:]}")
    tmp.replace(out)
    return out
