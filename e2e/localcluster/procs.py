"""Start the control plane's processes detached, and stop exactly those.

Every process is recorded in DIR/pids.json with its pid and the start time
the kernel reports for it (/proc/PID/stat field 22), so `down` can tell its
own process from an unrelated one that reused the pid, and never signals
anything it did not start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path


def _start_ticks(pid: int) -> int | None:
    """Start time of a live process; None if gone or a zombie (exited, not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces; fields after ')' are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _load(state_dir: Path) -> list[dict]:
    path = state_dir / "pids.json"
    return json.loads(path.read_text()) if path.exists() else []


def start(state_dir: Path, name: str, argv: list[str], env: dict[str, str] | None = None,
          ) -> subprocess.Popen:
    """Start `argv` in its own session, logging to DIR/logs/NAME.log."""
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})
    records = _load(state_dir)
    records.append({"name": name, "pid": proc.pid, "start": _start_ticks(proc.pid),
                    "argv": argv})
    (state_dir / "pids.json").write_text(json.dumps(records, indent=1))
    return proc


def newest(state_dir: Path, name: str) -> dict | None:
    """The record of the last process started as `name`, if any."""
    return next((r for r in reversed(_load(state_dir)) if r["name"] == name), None)


def alive(record: dict) -> bool:
    ticks = _start_ticks(record["pid"])
    return ticks is not None and ticks == record.get("start")


def check_running(state_dir: Path) -> list[str]:
    """Names of recorded processes that are no longer running."""
    return [r["name"] for r in _load(state_dir) if not alive(r)]


def _stop_one(record: dict, grace_s: float) -> bool:
    """SIGTERM, wait up to grace_s, then SIGKILL. Returns True if it had to kill."""
    try:
        os.kill(record["pid"], signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive(record):
        time.sleep(0.05)
    if not alive(record):
        return False
    try:
        os.kill(record["pid"], signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def stop_all(state_dir: Path, grace_s: float = 15.0) -> list[str]:
    """Stop every recorded process, newest first, one at a time.

    In reverse start order each process still has what it depends on while it
    shuts down (the API server still has etcd; nothing still watches the API
    server when it stops), so each exits cleanly within its grace period.
    Returns the names of the processes that had to be SIGKILLed.
    """
    killed = []
    for record in reversed(_load(state_dir)):
        if alive(record) and _stop_one(record, grace_s):
            killed.append(record["name"])
        try:  # reap it when the caller is its parent (the same Python process)
            os.waitpid(record["pid"], os.WNOHANG)
        except ChildProcessError:
            pass
    return killed


def stop_named(state_dir: Path, names: set[str], grace_s: float = 15.0) -> list[str]:
    """Stop the recorded processes called `names` (newest first); returns those SIGKILLed."""
    killed = []
    for record in reversed(_load(state_dir)):
        if record["name"] in names and alive(record) and _stop_one(record, grace_s):
            killed.append(record["name"])
    return killed
