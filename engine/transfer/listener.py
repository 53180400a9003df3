"""UCX listeners that bind the address their role was told to use.

ucxx 0.52's Python API binds every listener to the wildcard address; its C++ library can bind
one address, but the binding does not expose it. csrc/kvmesh_ucx_listener.pyx does: it is
compiled on first use (Cython and the system C++ compiler, about 5 s) into the kvmesh cache,
once per source, ucxx, Cython and Python version, as the native CPU kernels are. A wildcard host
("0.0.0.0", "::", "") needs no extension: ucxx's own listener binds it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kvmesh.engine.util.cache_dir import building, default_cache_dir

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})
_SOURCE = Path(__file__).with_name("csrc") / "kvmesh_ucx_listener.pyx"
_MODULE = "kvmesh_ucx_listener"
_CXXFLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-w"]
_build_lock = threading.Lock()


class ListenerBindError(RuntimeError):
    """The UCX listener cannot bind the address asked for (no compiler to build the extension
    that binds one address, or the address or port is unusable)."""


def create_listener(callback: Callable[[Any], Awaitable[None]], host: str, port: int) -> Any:
    """An asyncio ucxx ``Listener`` on ``host``:``port`` (port 0: any free port) calling
    ``callback(endpoint)`` per connection, with no handshake timeout (see server.py). Call on the
    event loop that runs the transfers."""
    import ucxx

    if host in WILDCARD_HOSTS:
        return ucxx.create_listener(callback, port=port, connect_timeout=None)
    ext = load_extension()
    from ucxx._lib_async.listener import Listener, _listener_handler, _ListenerHandlerTracker
    from ucxx._lib_async.utils import get_event_loop

    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()
    tracker = _ListenerHandlerTracker()
    # The same arguments ucxx's create_listener gives its handler: loop, callback, a weak
    # reference to the context, endpoint error handling, no connect timeout, the tracker.
    args = (get_event_loop(), callback, weakref.ref(ctx), True, None, tracker)
    try:
        raw = ext.create(ctx.worker, host, port, _listener_handler, args)
    except Exception as e:  # ucxx raises its own error types from C++
        raise ListenerBindError(f"cannot listen for KV transfers on {host}:{port}: {e} (is {host} an address "
                                "of this machine, and the port free?)") from e
    return Listener(raw, tracker, ctx)


def extension_path(cache_dir: Path | None = None) -> Path:
    """Where the compiled extension for this source and these versions lives (built or not)."""
    digest = hashlib.sha256(_SOURCE.read_bytes())
    for part in (sys.version, _version("ucxx-cu13"), _version("libucxx-cu13"), _version("Cython"), " ".join(_CXXFLAGS)):
        digest.update(part.encode())
    root = (cache_dir or default_cache_dir()) / "ucx-listener" / digest.hexdigest()[:16]
    return root / (_MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def load_extension(cache_dir: Path | None = None) -> ModuleType:
    """The compiled extension, built on first use. Raises ListenerBindError when it cannot be built."""
    loaded = sys.modules.get(_MODULE)
    if loaded is not None:
        return loaded
    target = extension_path(cache_dir)
    with _build_lock:
        if not target.exists():
            _build(target)
    spec = importlib.util.spec_from_file_location(_MODULE, target,
                                                  loader=importlib.machinery.ExtensionFileLoader(_MODULE, str(target)))
    if spec is None or spec.loader is None:
        raise ListenerBindError(f"cannot load {target}")
    import ucxx  # noqa: F401 - loads the UCX and libucxx libraries the extension links against

    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ListenerBindError(f"cannot load {target}: {e}; delete it to rebuild") from e
    sys.modules[_MODULE] = module
    return module


def _build(target: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise ListenerBindError("binding the UCX listener to one address needs a C++ compiler to build "
                                f"{_SOURCE.name} once (install g++ or set CXX), or bind every interface "
                                "with --host 0.0.0.0")
    if importlib.util.find_spec("Cython") is None:
        raise ListenerBindError(f"binding the UCX listener to one address needs Cython to build {_SOURCE.name} "
                                "once (pip install Cython), or bind every interface with --host 0.0.0.0")
    ucxx_dir, libucxx_dir, libucx_dir = (_package_dir(n) for n in ("ucxx", "libucxx", "libucx"))
    with building(target) as out:
        cpp = out.with_name(f"{_MODULE}.cpp")
        _run([sys.executable, "-m", "cython", "--cplus", "-3", "-I", str(ucxx_dir.parent), str(_SOURCE),
              "-o", str(cpp)], "Cython")
        lib = libucxx_dir / "lib64"
        _run([cxx, *_CXXFLAGS, f"-I{sysconfig.get_paths()['include']}", f"-I{libucxx_dir / 'include'}",
              f"-I{libucx_dir / 'include'}", f"-I{ucxx_dir / 'include'}", str(cpp), f"-L{lib}", "-lucxx",
              f"-Wl,-rpath,{lib}", "-o", str(out)], cxx)


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ListenerBindError(f"building {_SOURCE.name} with {what} failed: {e}") from e
    if proc.returncode != 0:
        raise ListenerBindError(f"building {_SOURCE.name} with {what} failed:\n{(proc.stderr or proc.stdout)[-2000:]}")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ListenerBindError(f"the {name} package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"
