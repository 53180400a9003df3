"""A same-host byte lane beside a UCX connection: block payloads through sealed shared memory,
chunk signals over a unix socket, requests over UCX.

When both ends of a connection see the same ``/dev/shm`` (``kvmesh up``'s processes, pods that
share the host's IPC namespace or a mounted ``/dev/shm``), payloads skip UCX's TCP path. Each
direction gets one anonymous shared-memory file (``memfd``) created by its writer, ``SLOTS`` slots
of ``chunk_bytes`` each, mapped by both ends, and the two ends keep a unix socket (the lane's
doorbell) for 16-byte chunk signals:

    sender:   copy chunk i -> slot i % SLOTS    ring FRAME(i, nbytes)
    receiver: wait FRAME(i)   copy slot -> destination views   ring ACK(i)

so a payload costs one user-space copy on each side, straight from the source views (a gathered
batch, the cache node's stored arrays) into the destination views (a pinned staging buffer, fresh
store arrays), and with two slots the writer fills one slot while the reader empties the other.
Both ends cut a payload into the same chunks (``plan`` depends only on the buffers' sizes), so a
signal carries only its index and byte count, which the receiver checks. The signals take the
socket rather than UCX because a UCX completion reaches the event loop through two more threads:
on a loaded 2-core machine a signal took longer to arrive that way than its chunk took to copy.

Why a sealed memfd: a peer that could shrink a file the other side maps would kill it with
SIGBUS on its next access. A memfd carries ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``, which
the kernel enforces for every holder and which can never be removed, so a mapping of the size
checked at setup stays valid for its life. A peer can still scribble on its own memory while the
reader copies, which only garbles bytes the peer was sending anyway; the reader maps it read-only.

Setting up (after the token handshake, so only an authenticated peer gets this far). Memfds have
no names, so they travel over a unix socket in ``/dev/shm`` (``SCM_RIGHTS``)::

    client: memfd_c (nonce_c at its start); listens on /dev/shm/kvmesh-kv-<32 hex>
    client -> ShmOffer(name, nonce_c)                       over UCX
    server: connects, sends nonce_c + memfd_s, receives memfd_c, checks it (seals, size, nonce_c)
    server -> ShmAccept(nonce_s)  or ShmDecline(reason)     over UCX: the network path stays
    client: takes the one connection that proved nonce_c, checks memfd_s holds nonce_s;
            that connection stays open as the doorbell

Invariants: the socket's name is unlinked as soon as its one connection is taken (or the offer
fails), so nothing is left in ``/dev/shm``; the unix peer must be this user (``SO_PEERCRED``);
a chunk is written only after the receiver acknowledged the chunk that used its slot before (the
sender keeps at most ``SLOTS`` chunks unacknowledged); a mapping is unmapped only once no copy
runs; a peer that dies closes the doorbell, so a waiting end fails at once with ``PeerGone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import re
import secrets
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import PeerGone, ProtocolError, TransferTimeout

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"kvmesh-kv-[0-9a-f]{32}\Z")
SLOTS = 2
DEFAULT_CHUNK_BYTES = 16 << 20
"""16 MiB: large enough that a frame's round trip (~0.1 ms) is small beside its copy, small enough
that a lane costs 2 x 32 MiB of shared memory per connection."""
NONCE_BYTES = 16
EXCHANGE_TIMEOUT = 5.0
"""Seconds the unix-socket exchange of memfds may take before the lane is given up."""
ENV_SWITCH = "KVMESH_KV_SHM"
"""``0``/``off``/``no`` disables the lane in a process (both its clients and its servers)."""
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
FRAME, ACK, MESSAGE = 1, 2, 3
"""Bell records: chunk ``index`` is in its slot (``nbytes`` bytes); the reader is done with it; a
control message of ``nbytes`` bytes follows."""
_BELL = struct.Struct("<IIQ")  # kind, index, nbytes


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


def socket_path(name: str) -> str:
    """The path of a lane's exchange socket; anything but ``kvmesh-kv-<32 hex>`` is a protocol error."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ProtocolError(f"not a kvmesh lane name: {name!r:.80}")
    return os.path.join(SHM_DIR, name)


# ---- the shared memory ---------------------------------------------------------------------------
def create_memfd(size: int) -> tuple[int, bytes]:
    """A sealed memfd of ``size`` bytes (allocated now, so a full memory cgroup fails here and not
    mid-transfer) with a fresh nonce at its start: (fd, nonce)."""
    try:
        fd = os.memfd_create("kvmesh-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as e:
        raise LaneUnavailable(f"no memfd here: {e}") from None
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        nonce = secrets.token_bytes(NONCE_BYTES)
        os.pwrite(fd, nonce, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as e:
        os.close(fd)
        raise LaneUnavailable(f"cannot allocate a {size >> 20} MiB lane: {e}") from None
    return fd, nonce


def check_peer_memfd(fd: int, nonce: bytes, min_size: int) -> None:
    """Raise ``ProtocolError`` unless ``fd`` is a memfd that can never shrink, of at least
    ``min_size`` bytes, holding ``nonce`` at its start (so it is the peer's lane and mapping it is safe)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ProtocolError("the peer's lane is not a sealable memfd") from None
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL:
        raise ProtocolError("the peer's lane is not sealed against shrinking")
    if os.fstat(fd).st_size < min_size:
        raise ProtocolError(f"the peer's lane is smaller than {min_size} bytes")
    if len(nonce) != NONCE_BYTES or os.pread(fd, NONCE_BYTES, 0) != nonce:
        raise ProtocolError("the peer's lane holds another nonce: not the peer's memory")


# ---- the exchange over a unix socket ---------------------------------------------------------------
def listen(name: str | None = None) -> tuple[socket.socket, str]:
    """The offering side's one-shot exchange socket in ``/dev/shm``: (listening socket, name)."""
    if not os.path.isdir(SHM_DIR):
        raise LaneUnavailable(f"{SHM_DIR} does not exist")
    name = name or f"kvmesh-kv-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        old = os.umask(0o177)  # the socket file is born 0600: only this user may connect
        try:
            sock.bind(socket_path(name))
        finally:
            os.umask(old)
        sock.listen(4)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise LaneUnavailable(f"cannot listen in {SHM_DIR}: {e}") from None
    return sock, name


def unlink_socket(name: str) -> None:
    with contextlib.suppress(FileNotFoundError, ProtocolError):
        os.unlink(socket_path(name))


@dataclass
class Peer:
    """What an exchange brought: the peer's memfd (unchecked) and the connection, the lane's bell."""

    fd: int
    bell: socket.socket

    def close(self) -> None:
        """Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.bell.close()


async def hand_over(listener: socket.socket, name: str, out_fd: int, nonce: bytes) -> Peer:
    """Offering side: take the first connection that proves ``nonce`` and give it ``out_fd``; the
    peer's memfd is checked later (its nonce arrives over UCX). Unlinks the socket's name."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            conn, _ = await loop.sock_accept(listener)
            try:
                peer_fd = await _recv_fd(conn, nonce)
            except ProtocolError:
                conn.close()
                continue  # not our peer (another local process that found the name): wait on
            try:
                socket.send_fds(conn, [b"k"], [out_fd])
            except OSError:
                os.close(peer_fd)
                conn.close()
                raise
            return Peer(peer_fd, conn)
    finally:
        unlink_socket(name)
        listener.close()


async def take_over(name: str, out_fd: int, nonce: bytes) -> Peer:
    """Answering side: connect to the offer's socket, prove ``nonce`` while giving ``out_fd``, and
    take the offerer's memfd. ``LaneUnavailable`` when the socket is not visible (another host)."""
    path = socket_path(name)
    loop = asyncio.get_running_loop()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.setblocking(False)
        try:
            await loop.sock_connect(conn, path)
        except OSError as e:
            raise LaneUnavailable(f"peer's lane {name} is not reachable here ({e.strerror}): another host") from None
        _check_same_user(conn)
        socket.send_fds(conn, [nonce], [out_fd])
        return Peer(await _recv_fd(conn, b"k"), conn)
    except BaseException:
        conn.close()
        raise


async def _recv_fd(conn: socket.socket, expect: bytes) -> int:
    _check_same_user(conn)
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())
    try:
        data, fds, flags, _ = socket.recv_fds(conn, 64, 2)
    except OSError as e:
        raise ProtocolError(f"lane exchange failed: {e}") from None
    if data != expect or len(fds) != 1 or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("the lane exchange's peer did not prove the offer's nonce")
    return fds[0]


def _check_same_user(conn: socket.socket) -> None:
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        raise ProtocolError(f"the lane exchange's peer runs as uid {uid}, not this user")


def join(out_fd: int, peer: Peer, nonce: bytes, chunk_bytes: int) -> ShmLane:
    """The lane of this side's ``out_fd`` and an exchanged ``peer`` whose memfd must hold ``nonce``.
    Takes both: on success the lane holds them, on failure (``ProtocolError``, ``LaneUnavailable``)
    they are closed."""
    try:
        check_peer_memfd(peer.fd, nonce, SLOTS * chunk_bytes)
    except ProtocolError:
        os.close(out_fd)
        peer.close()
        raise
    in_fd, peer.fd = peer.fd, -1
    return ShmLane.of(out_fd, in_fd, chunk_bytes, peer.bell)


# ---- a lane in use ---------------------------------------------------------------------------------
def _map(fd: int, size: int, writable: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # Populated now: the first payload should not pay a page fault per 4 KiB of the lane.
    return mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot)


@dataclass
class ShmLane:
    """Both directions of one connection's lane, mapped: ``out`` is written here, ``inp`` read here;
    ``bell`` carries the chunk signals. Built from two memfds, which it closes (the mappings
    outlive them). One payload at a time (the channel's), so the bell is never read twice at once."""

    chunk_bytes: int
    bell: socket.socket | None = None
    out: np.ndarray | None = None
    inp: np.ndarray | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    _maps: list[mmap.mmap] = field(default_factory=list, repr=False)
    _closed: bool = field(default=False, repr=False)
    _busy: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, out_fd: int, in_fd: int, chunk_bytes: int, bell: socket.socket) -> ShmLane:
        """Map ``out_fd`` read-write and the (checked) peer's ``in_fd`` read-only; closes both fds.
        Takes ``bell`` (closed with the lane, or now if mapping fails)."""
        lane = cls(chunk_bytes, bell)
        try:
            bell.setblocking(False)  # the loop's socket calls must never block it
            size = lane.file_bytes
            for fd, writable in ((out_fd, True), (in_fd, False)):
                m = _map(fd, size, writable)
                lane._maps.append(m)
                if writable:
                    lane.out = np.frombuffer(m, np.uint8)
                else:
                    lane.inp = np.frombuffer(m, np.uint8)  # read-only: the mapping has no PROT_WRITE
        except (OSError, ValueError) as e:
            lane.close()
            raise LaneUnavailable(f"cannot map the lane: {e}") from None
        finally:
            os.close(out_fd)
            os.close(in_fd)
        return lane

    @property
    def file_bytes(self) -> int:
        return SLOTS * self.chunk_bytes

    def write(self, index: int, views: Sequence[np.ndarray]) -> int:
        """Copy one chunk's pieces into slot ``index % SLOTS``; returns its byte count."""
        with self._using():
            n = _gather(self.out, (index % SLOTS) * self.chunk_bytes, views, into_slot=True)
        self.bytes_sent += n
        return n

    def read(self, index: int, views: Sequence[np.ndarray]) -> int:
        """Fill ``views`` from slot ``index % SLOTS``."""
        want = sum(v.nbytes for v in views)
        if want > self.chunk_bytes:
            raise ProtocolError(f"lane chunk {index}: {want} bytes do not fit a {self.chunk_bytes}-byte slot")
        with self._using():
            got = _gather(self.inp, (index % SLOTS) * self.chunk_bytes, views, into_slot=False)
        self.bytes_received += got
        return got

    async def ring(self, kind: int, index: int, nbytes: int = 0) -> None:
        """Signal ``kind`` for chunk ``index`` to the peer."""
        await self._send(_BELL.pack(kind, index, nbytes))

    async def wait(self, kind: int, index: int, nbytes: int | None = None) -> None:
        """Wait for the peer's signal ``kind`` for chunk ``index`` (of ``nbytes`` bytes, when given);
        any other record is a ``ProtocolError``, a closed bell ``PeerGone``."""
        k, i, n = _BELL.unpack(await self._read(_BELL.size))
        if (k, i) != (kind, index) or (nbytes is not None and n != nbytes):
            want = f"{'frame' if kind == FRAME else 'ack'} {index}" + ("" if nbytes is None else f" of {nbytes} bytes")
            raise ProtocolError(f"lane signal ({k}, {i}, {n}) where {want} was due")

    async def send_message(self, body: bytes) -> None:
        """One control message (the channel's encoded body) on the bell."""
        await self._send(_BELL.pack(MESSAGE, 0, len(body)) + body)

    async def recv_message(self, max_bytes: int, rest_timeout: float | None) -> bytes:
        """The next control message's body. ``ProtocolError`` for anything but a message of
        1..``max_bytes`` bytes; ``TransferTimeout`` when its body does not follow its header within
        ``rest_timeout`` (a peer cannot pin the connection with half a message)."""
        k, _, n = _BELL.unpack(await self._read(_BELL.size))
        if k != MESSAGE:
            raise ProtocolError(f"lane record of kind {k} where a control message was due")
        if not 0 < n <= max_bytes:
            raise ProtocolError(f"the lane's peer announced a {n}-byte control message (limit {max_bytes})")
        try:
            return await asyncio.wait_for(self._read(n), rest_timeout)
        except TimeoutError:
            raise TransferTimeout(f"the lane's peer sent a {n}-byte message's header and not its body "
                                  f"within {rest_timeout:.0f}s") from None

    async def _send(self, data: bytes) -> None:
        bell = self._bell()
        try:
            await asyncio.get_running_loop().sock_sendall(bell, data)
        except OSError as e:
            raise PeerGone(f"the lane's peer is gone ({e.strerror or e})") from None

    async def _read(self, size: int) -> bytes:
        bell = self._bell()
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        loop = asyncio.get_running_loop()
        while got < size:
            try:
                n = await loop.sock_recv_into(bell, view[got:])
            except OSError as e:
                raise PeerGone(f"the lane's peer is gone ({e.strerror or e})") from None
            if n == 0:
                raise PeerGone("the lane's peer closed it")
            got += n
        return bytes(buf)

    def _bell(self) -> socket.socket:
        if self.bell is None or self._closed:
            raise ProtocolError("the lane is closed")
        return self.bell

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        # A copy may run on a worker thread while the connection is aborted: the mappings are
        # unmapped only after it ends, so it can never touch memory that is gone.
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
                self._unmap()

    def close(self) -> None:
        """Close the bell now (a waiting peer fails at once) and unmap both directions once no copy
        runs. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._busy == 0
        if self.bell is not None:
            _close_bell(self.bell)
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        self.out = self.inp = None  # drop the arrays' exports first, or mmap.close refuses
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still alive somewhere: the GC unmaps it
                m.close()
        self._maps = []


def _close_bell(bell: socket.socket) -> None:
    # Shut down first: the peer and any waiter here see end-of-stream at once. A waiter on this
    # thread's loop runs after the close below is done (it is queued first) and gets EBADF, which
    # ``wait`` reports as PeerGone like the end-of-stream.
    with contextlib.suppress(OSError):
        bell.shutdown(socket.SHUT_RDWR)
    try:
        asyncio.get_running_loop().call_soon(bell.close)
    except RuntimeError:  # not on a loop: nothing here can be waiting on it
        bell.close()


def _gather(region: np.ndarray | None, offset: int, views: Sequence[np.ndarray], *, into_slot: bool) -> int:
    """Copy ``views`` (uint8, contiguous) to/from ``region`` starting at ``offset``, in order.
    numpy releases the GIL for each copy, so a copy on a worker thread runs beside the loop."""
    if region is None:
        raise ProtocolError("the lane is closed")
    pos = offset
    for v in coalesce(views):
        n = v.nbytes
        if not n:
            continue
        if not v.flags.c_contiguous:
            raise ValueError("lane copies need contiguous buffers")
        flat = v.reshape(-1).view(np.uint8)
        if into_slot:
            np.copyto(region[pos:pos + n], flat)
        else:
            np.copyto(flat, region[pos:pos + n])
        pos += n
    return pos - offset


def coalesce(views: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``views`` with runs of back-to-back slices of one contiguous buffer merged into one view each
    (a fetched batch lands in consecutive views of one staging buffer): one large copy runs at
    memory speed where dozens of block-sized ones do not. Same bytes, same order."""
    out: list[np.ndarray] = []
    run_base: np.ndarray | None = None
    run_start = run_end = 0
    for v in views:
        base = v.base if isinstance(v.base, np.ndarray) else None
        if base is not None and (base.ndim != 1 or base.dtype != np.uint8 or not base.flags.c_contiguous
                                 or not v.flags.c_contiguous):
            base = None
        if base is None:
            if run_base is not None:
                out.append(run_base[run_start:run_end])
                run_base = None
            out.append(v)
            continue
        start = v.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        if run_base is base and start == run_end:
            run_end += v.nbytes
            continue
        if run_base is not None:
            out.append(run_base[run_start:run_end])
        run_base, run_start, run_end = base, start, start + v.nbytes
    if run_base is not None:
        out.append(run_base[run_start:run_end])
    return out
