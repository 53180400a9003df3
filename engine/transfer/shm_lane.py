"""A same-host byte lane beside a UCX connection: block payloads through tmpfs, control over UCX.

When both ends of a connection see the same ``/dev/shm`` (``kvmesh up``'s processes, pods that
share the host's IPC namespace or a mounted ``/dev/shm``), payloads skip UCX's TCP path. Each
direction gets one tmpfs file, created by its writer, ``SLOTS`` slots of ``chunk_bytes`` each:

    sender:   pwritev(chunk i -> slot i % SLOTS)    send ShmFrame(i, nbytes)
    receiver: recv ShmFrame(i)   preadv(slot -> destination views)   send ShmAck(i)

so a payload costs one kernel copy on each side, straight from the source views (a gathered
batch, the cache node's stored arrays) into the destination views (a pinned staging buffer, fresh
store arrays), and with two slots the writer fills one slot while the reader empties the other.
Both ends cut a payload into the same chunks (``plan`` depends only on the buffers' sizes), so a
frame carries only its index and byte count, which the receiver checks.

Why files and syscalls rather than a shared mapping: a peer that truncates a file mapped by the
other side would kill it with SIGBUS on the next access; a ``preadv`` from a truncated file only
comes back short, which is a ``ProtocolError`` for that connection alone.

Setting up (after the token handshake, so only an authenticated peer gets this far)::

    client -> ShmOffer(name_c, nonce_c)     the client's file holds nonce_c at its start
    server -> ShmAccept(name_s, nonce_s)    or ShmDecline(reason): the network path stays
    each side opens the other's file, checks the nonce, and unlinks the name

Invariants: a lane file is a regular file owned by this user, named ``kvmesh-kv-<32 hex>``,
opened without following links; a name is unlinked as soon as the other side opened it (or when
its writer closes), so a crashed process leaves nothing behind in ``/dev/shm`` once its peer has
connected; a chunk is written only after the receiver acknowledged the chunk that used its slot
before (the sender keeps at most ``SLOTS`` chunks unacknowledged).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import ProtocolError

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"kvmesh-kv-[0-9a-f]{32}\Z")
SLOTS = 2
DEFAULT_CHUNK_BYTES = 16 << 20
"""16 MiB: large enough that a frame's round trip (~0.1 ms) is small beside its copy, small enough
that a lane costs 2 x 32 MiB of tmpfs per connection."""
NONCE_BYTES = 16
ENV_SWITCH = "KVMESH_KV_SHM"
"""``0``/``off``/``no`` disables the lane in a process (both its clients and its servers)."""


class LaneUnavailable(OSError):
    """This side cannot offer or take a lane (no /dev/shm, no room, another host); the network path stays."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "no", "false")


Piece = tuple[int, int, int]
"""(buffer index, start byte, end byte) of one contiguous piece of a payload."""


def plan(sizes: Sequence[int], chunk_bytes: int) -> list[list[Piece]]:
    """Cut buffers of ``sizes`` (in order) into chunks of at most ``chunk_bytes``; both ends compute
    the same plan from the same sizes. A buffer larger than a chunk spans several."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks: list[list[Piece]] = []
    cur: list[Piece] = []
    room = chunk_bytes
    for i, size in enumerate(sizes):
        pos = 0
        while pos < size:
            take = min(size - pos, room)
            cur.append((i, pos, pos + take))
            pos += take
            room -= take
            if room == 0:
                chunks.append(cur)
                cur, room = [], chunk_bytes
    if cur:
        chunks.append(cur)
    return chunks


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ProtocolError(f"not a kvmesh lane name: {name!r:.80}")
    return os.path.join(SHM_DIR, name)


def create_lane_file(size: int) -> tuple[int, str, bytes]:
    """A new lane file of ``size`` bytes (allocated now, so a full tmpfs fails here and not
    mid-transfer) with a fresh nonce at its start: (fd, name, nonce)."""
    if not os.path.isdir(SHM_DIR):
        raise LaneUnavailable(f"{SHM_DIR} does not exist")
    name = f"kvmesh-kv-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        nonce = secrets.token_bytes(NONCE_BYTES)
        os.pwrite(fd, nonce, 0)
    except OSError as e:
        os.close(fd)
        _unlink(path)
        raise LaneUnavailable(f"cannot allocate a {size >> 20} MiB lane in {SHM_DIR}: {e}") from None
    return fd, name, nonce


def open_peer_file(name: str, nonce: bytes, min_size: int) -> int:
    """Open the peer's lane file, check it is one (owner, type, size, nonce), unlink its name."""
    path = _check_name(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise LaneUnavailable(f"peer's lane {name} is not visible here ({e.strerror}): another host") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < min_size:
            raise ProtocolError(f"peer's lane {name} is not a {min_size}-byte file of this user")
        if len(nonce) != NONCE_BYTES or os.pread(fd, NONCE_BYTES, 0) != nonce:
            raise LaneUnavailable(f"peer's lane {name} holds another nonce: not the peer's file")
    except BaseException:
        os.close(fd)
        raise
    _unlink(path)
    return fd


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass
class ShmLane:
    """Both directions of one connection's lane: ``out_fd`` is written here, ``in_fd`` read here."""

    out_fd: int
    out_name: str
    in_fd: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    bytes_sent: int = 0
    bytes_received: int = 0
    _closed: bool = field(default=False, repr=False)
    _busy: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def file_bytes(self) -> int:
        return SLOTS * self.chunk_bytes

    def write(self, index: int, views: Sequence[np.ndarray]) -> int:
        """Write one chunk's pieces into slot ``index % SLOTS``; returns its byte count."""
        with self._using():
            n = _vectored(os.pwritev, self.out_fd, views, (index % SLOTS) * self.chunk_bytes)
        self.bytes_sent += n
        return n

    def read(self, index: int, views: Sequence[np.ndarray]) -> int:
        """Fill ``views`` from slot ``index % SLOTS``; a short read (the file was cut) is a protocol error."""
        want = sum(v.nbytes for v in views)
        with self._using():
            got = _vectored(os.preadv, self.in_fd, views, (index % SLOTS) * self.chunk_bytes)
        if got != want:
            raise ProtocolError(f"lane chunk {index}: read {got} of {want} bytes (the peer cut its file)")
        self.bytes_received += got
        return got

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        # A copy may run on a worker thread while the connection is aborted: the descriptors are
        # closed only after it ends, so it can never reach a file that reused their numbers.
        with self._lock:
            if self._closed:
                raise ProtocolError("the lane is closed")
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                last = self._closed and self._busy == 0
            if last:
                self._close_fds()

    def close(self) -> None:
        """Unlink this side's name if the peer never took it, and close both files once no copy
        runs. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._busy == 0
        _unlink(os.path.join(SHM_DIR, self.out_name))
        if idle:
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self.out_fd, self.in_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _vectored(call, fd: int, views: Sequence[np.ndarray], offset: int) -> int:  # noqa: ANN001
    """One ``preadv``/``pwritev`` per ``IOV_MAX`` views, continuing after partial transfers."""
    total = 0
    bufs = [memoryview(v).cast("B") for v in views if v.nbytes]
    i = 0
    while i < len(bufs):
        batch = bufs[i:i + _IOV_MAX]
        n = call(fd, batch, offset + total)
        if n == 0:
            return total  # end of file: the caller checks the count
        total += n
        # Skip whole buffers done; re-slice a partly done one.
        while n and i < len(bufs):
            if n >= bufs[i].nbytes:
                n -= bufs[i].nbytes
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0
    return total
