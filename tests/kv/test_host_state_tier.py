"""The host checkpoint tier and its use by HybridStateManager, on real tensors (no model).

Real: ``HostStateTier`` copying to and from checkpoint tensors shaped like ``StatePool``'s,
``CheckpointIndex`` and ``HybridStateManager`` as the engine drives them; hashes are made up.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kv.host_state_tier import HostStateTier
from kvmesh.engine.kv.hybrid_state import HybridStateManager
from kvmesh.engine.kv.state_checkpoints import CheckpointIndex

L, N = 3, 2  # state layers, device entries
CONV, SSM = (L, 6, 3), (L, 2, 4, 4)


def _pool() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((L, N, *CONV[1:]), dtype=torch.bfloat16), torch.zeros((L, N, *SSM[1:]))


def _fill(conv, ssm, entry: int, value: float) -> None:
    conv[:, entry] = value
    ssm[:, entry] = value


def _h(i: int) -> bytes:
    return bytes([i]) * 32


def _manager(host_slots: int) -> tuple[HybridStateManager, HostStateTier]:
    host = HostStateTier(host_slots, CONV, torch.bfloat16, SSM, torch.device("cpu"))
    return HybridStateManager(4, 16, CheckpointIndex(N), host=host), host


def _publish(m: HybridStateManager, conv, ssm, h: bytes, value: float) -> int:
    idx = m.checkpoints.reserve()
    m.flush(conv, ssm)  # an eviction by this reserve is copied out before the entry is written
    _fill(conv, ssm, idx, value)
    m._publish(idx, h)
    return idx


def _published(host_slots: int, n: int):
    """A manager with ``host_slots`` host slots after checkpoints 0..n-1 were published in order
    (checkpoint i filled with i + 1): (manager, host tier, device conv, device ssm)."""
    m, host = _manager(host_slots)
    conv, ssm = _pool()
    for i in range(n):
        _publish(m, conv, ssm, _h(i), float(i + 1))
    return m, host, conv, ssm


def test_evicted_checkpoint_moves_to_host_and_back_with_its_bytes():
    m, host, conv, ssm = _published(4, 3)  # the third evicts the first (LRU) into the host tier
    assert host.has(_h(0)) and _h(0) not in m.checkpoints and host.stats.stored == 1
    assert torch.equal(host.ssm[host._lru[_h(0)]], torch.full(SSM, 1.0))
    m.check_integrity()
    blocks, entry = m.hit([_h(9), _h(0)], 2)  # the hit ends at block 2, whose checkpoint is on the host
    assert blocks == 2 and entry is not None
    m.allocate("r", entry)
    assert _h(0) in m.checkpoints and not host.has(_h(0))
    m.flush(conv, ssm)  # the evicted entry's save first, then the promotion's load
    assert torch.equal(ssm[:, entry], torch.full(SSM, 1.0)) and torch.equal(conv[:, entry], torch.full(CONV, 1.0,
                                                                                                    dtype=torch.bfloat16))
    plan = m.plan([], lambda *a: [])
    m.commit(plan)
    m.free("r")
    m.check_integrity()


def test_cancelled_promotion_gives_everything_back():
    m, host, conv, ssm = _published(4, 3)
    blocks, entry = m.hit([_h(0)], 1)
    assert blocks == 1
    m.cancel(entry)
    assert host.has(_h(0)) and _h(0) not in m.checkpoints
    m.check_integrity()


def test_host_lru_evicts_and_drops_when_full():
    m, host, conv, ssm = _published(1, 4)
    # Device holds 2 and 3; the host's single slot went to 0, then 1 evicted it.
    assert host.hashes() == {_h(1)} and host.stats.evictions == 1 and host.stats.stored == 2
    m.check_integrity()


def test_recomputed_checkpoint_drops_the_host_copy():
    m, host, conv, ssm = _published(4, 3)
    assert host.has(_h(0))
    _publish(m, conv, ssm, _h(0), 1.0)  # captured again on the device: one copy only
    assert not host.has(_h(0)) and _h(0) in m.checkpoints
    m.check_integrity()


def test_needs_a_slot():
    with pytest.raises(ValueError, match="cpu-state-bytes"):
        HostStateTier(0, CONV, torch.bfloat16, SSM, torch.device("cpu"))


def test_checkpoint_events_of_both_media_mirror_what_each_holds_and_predict_the_hit():
    """What the engine announces (``state-gpu`` from the device index, ``state-cpu`` from the host
    tier), replayed as the router replays it, equals each tier's contents after saves, LRU
    evictions, a promotion, a cancelled one and a recapture; and the router's rule over those
    sets (``restorable_blocks`` over every state medium) gives the manager's own hit."""
    from kvmesh.engine.kv.events import TIER_CPU, apply_event, checkpoint_removed, checkpoint_stored
    from kvmesh.engine.kv.state_checkpoints import restorable_blocks

    seen: dict[str, set[bytes]] = {}
    ck = CheckpointIndex(N, on_publish=lambda h: apply_event(seen, checkpoint_stored([h], 16)),
                         on_evict=lambda e, h: apply_event(seen, checkpoint_removed([h])))
    host = HostStateTier(2, CONV, torch.bfloat16, SSM, torch.device("cpu"))
    host.on_stored = lambda hs: apply_event(seen, checkpoint_stored(hs, 16, TIER_CPU))
    host.on_removed = lambda hs: apply_event(seen, checkpoint_removed(hs, TIER_CPU))
    m = HybridStateManager(4, 16, ck, host=host)
    conv, ssm = _pool()

    def mirrored() -> None:
        assert seen.get("state-gpu", set()) == ck.hashes() and seen.get("state-cpu", set()) == host.hashes()
        assert "gpu" not in seen and "cpu" not in seen  # KV media untouched by checkpoint events

    for i in range(5):  # device keeps 3, 4; host keeps 1, 2 (0 fell off its LRU)
        _publish(m, conv, ssm, _h(i), float(i + 1))
        mirrored()
    assert ck.hashes() == {_h(3), _h(4)} and host.hashes() == {_h(1), _h(2)}
    chain = [_h(i) for i in range(5)]
    ckpts = lambda h: any(h in s for k, s in seen.items() if k.startswith("state-"))  # noqa: E731
    for n in range(6):
        predicted = restorable_blocks(chain, n, ckpts)
        blocks, entry = m.hit(chain, n)
        assert blocks == predicted, n
        m.cancel(entry)  # a host hit reserved both ends: give them back
        mirrored()
    blocks, entry = m.hit([_h(9), _h(1)], 2)  # promote 1 from the host
    m.allocate("r", entry)
    m.flush(conv, ssm)
    mirrored()
    _publish(m, conv, ssm, _h(2), 3.0)  # recaptured on the device: the host copy goes
    mirrored()
    assert _h(2) not in host.hashes()
    m.check_integrity()
