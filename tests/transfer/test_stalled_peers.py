"""A peer that stalls or dies mid-transfer never takes down the process that talks to it (slow).

Real: ucxx over TCP with the server processes' settings, a real `kvmesh cache-node` process as the
peer, SIGSTOP/SIGCONT/SIGKILL. The driver runs as its own process (tests/transfer/
stalled_peer_driver.py) so that a corrupted interpreter is a failed test. Before the transport
posted every ucxx operation to completion and stopped abandoning handshakes (transfer/posted.py,
client._connect), this driver died with SIGSEGV within five cycles on every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # stalls and kills real peers many times: about 45 s
ROOT = Path(__file__).resolve().parents[2]


def test_stalled_and_killed_peers_many_times_in_a_row():
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "tests.transfer.stalled_peer_driver",
                           "--cycles", "12", "--kill-every", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    tail = "\n".join(line for line in proc.stderr.splitlines() if "UCX  WARN" not in line)[-4000:]
    assert proc.returncode == 0, f"the driver died with {proc.returncode}:\n{tail}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    counts = report["counts"]
    assert counts.get("ok") == 12, counts  # every cycle's first request, after a resume or a restart
    assert counts.get("resumed") == 9 and counts.get("killed") == 3, counts
    assert counts.get("TransferTimeout", 0) + counts.get("ConnectFailed", 0) >= 12 * 2, counts
    assert report["posted_left"] == 0, report
