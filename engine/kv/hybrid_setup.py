"""Build a hybrid model's recurrent-state bookkeeping (``HybridStateManager``) and wire its hooks
to the engine's KV events: checkpoints stored and evicted per medium, and branch points."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..config import EngineConfig
from ..model.recurrent_state import StatePool
from ..block_hash import BlockHash
from .events import BRANCH_MEDIUM, TIER_CPU, BlockRemoved, KVEvent, branch_points, checkpoint_removed, checkpoint_stored
from .hybrid_state import HybridStateManager
from .state_checkpoints import CheckpointIndex
from .tiers import KVTiers


def build_state_manager(cfg: EngineConfig, pool: StatePool, linear_layers: Sequence[int], num_checkpoints: int,
                        entry_bytes: int, tiers: KVTiers | None,
                        publish: Callable[[KVEvent], None]) -> HybridStateManager:
    """The engine's state slots (one per running sequence), its checkpoint pool of
    ``num_checkpoints`` entries of ``entry_bytes`` (none: no hybrid prefix hits; ``pool``: the
    runner's ``StatePool``) with the host and cache-node tiers
    ``tiers`` has, every change published through ``publish`` (the engine's ``KVEventLog``).

    The hooks hold ``publish`` only, never the engine, so no cycle keeps an engine alive."""
    bs = cfg.block_size
    ckpts = host_states = None
    if num_checkpoints:
        # Subscribers (the router) learn which block ends have a restore point: a hybrid prefix
        # hit stops at the last of them (state_checkpoints.restorable_blocks).
        ckpts = CheckpointIndex(num_checkpoints, entry_bytes,
                                on_publish=lambda h: publish(checkpoint_stored([h], bs)),
                                on_evict=lambda entry, h: publish(checkpoint_removed([h])))
        if tiers is not None:
            from .tier_setup import build_state_tier, enable_remote_states

            host_states = build_state_tier(cfg, pool.ckpt_conv, pool.ckpt_ssm)
            if host_states is not None:
                host_states.on_stored = lambda hs: publish(checkpoint_stored(hs, bs, TIER_CPU))
                host_states.on_removed = lambda hs: publish(checkpoint_removed(hs, TIER_CPU))
            enable_remote_states(tiers, linear_layers, pool.ckpt_conv, pool.ckpt_ssm)
    states = HybridStateManager(cfg.max_num_seqs, bs, ckpts, cfg.state_checkpoint_interval, host=host_states,
                                on_branch=lambda h, old: _branch(publish, h, old, bs))
    states.write_through = ckpts is not None and tiers is not None and tiers.remote is not None
    return states


def _branch(publish: Callable[[KVEvent], None], h: BlockHash, displaced: BlockHash | None, block_size: int) -> None:
    publish(branch_points([h], block_size))
    if displaced is not None:  # the engine forgot it: so do its subscribers (the log stays bounded)
        publish(BlockRemoved([displaced], BRANCH_MEDIUM))
