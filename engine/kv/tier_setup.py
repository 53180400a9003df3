"""Build the lower KV tiers an ``EngineConfig`` asks for (``cpu_kv_bytes``, ``cache_node``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..config import ConfigError, EngineConfig
from kvmesh.engine.kv.gather import block_shape, cache_layout
from .events import KVEventHandler
from .host_state_tier import HostStateTier
from .host_tier import HostTier
from .kv_manager import KVCacheManager
from .remote_tier import RemoteTier
from .state_wire import StateGeometry, checkpoint_layout
from .tiers import KVTiers


def build_tiers(cfg: EngineConfig, kv: KVCacheManager, kv_cache: torch.Tensor,
                on_event: KVEventHandler, max_model_len: int) -> tuple[KVTiers, Any]:
    """(tiers, cache-node link or None). ``kv_cache`` is [layers, 2, blocks, block_size, heads, dim]."""
    if not kv.enable_caching:
        raise ConfigError("--cpu-kv-bytes and --cache-node need prefix caching (drop --no-prefix-caching)")
    shape = block_shape(kv_cache)
    bs = shape[2]
    block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
    host = None
    if cfg.cpu_kv_bytes:
        slots = cfg.cpu_kv_bytes // block_bytes
        if slots < 1:
            raise ConfigError(f"--cpu-kv-bytes {cfg.cpu_kv_bytes} holds no KV block of {block_bytes} bytes")
        host = HostTier(slots, shape, kv_cache.dtype, kv_cache.device, bs, on_event)
    remote, link = None, None
    if cfg.cache_node:
        from ..api.auth import TokenFile
        from .node_link import CacheNodeLink

        token = TokenFile(cfg.auth_token_file) if cfg.auth_token_file else None
        # A fetch holds at most the blocks before a longest prompt's last token.
        max_fetch = min(kv_cache.shape[2], (max_model_len - 1) // bs) * block_bytes
        link = CacheNodeLink(cfg.cache_node, timeout=cfg.cache_node_timeout,
                             token=lambda: token.token if token is not None else None, max_fetch_bytes=max_fetch)
        link.wait_first(min(cfg.cache_node_timeout, 5.0))
        remote = RemoteTier(link.clients, cache_layout(kv.extra, kv_cache), shape, kv_cache.dtype,
                            timeout=cfg.cache_node_timeout, on_failure=link.on_failure, staging=link.staging)
    return KVTiers(kv, kv_cache, host, remote), link


def build_state_tier(cfg: EngineConfig, ckpt_conv: torch.Tensor, ckpt_ssm: torch.Tensor) -> HostStateTier | None:
    """The host checkpoint tier of a hybrid model (``cpu_state_bytes``, default a quarter of
    ``cpu_kv_bytes``), or None without a host KV tier. ``ckpt_*``: ``StatePool``'s entries."""
    if not cfg.cpu_kv_bytes:
        return None
    budget = cfg.cpu_state_bytes or cfg.cpu_kv_bytes // 4
    conv_shape, ssm_shape = (ckpt_conv.shape[0], *ckpt_conv.shape[2:]), (ckpt_ssm.shape[0], *ckpt_ssm.shape[2:])
    entry = (ckpt_conv[:, 0].numel() * ckpt_conv.element_size() + ckpt_ssm[:, 0].numel() * ckpt_ssm.element_size())
    if budget // entry < 1:
        raise ConfigError(f"--cpu-state-bytes {budget} holds no recurrent-state checkpoint of {entry} bytes")
    return HostStateTier(budget // entry, conv_shape, ckpt_conv.dtype, ssm_shape, ckpt_conv.device)


def enable_remote_states(tiers: KVTiers, layer_ids: Sequence[int], ckpt_conv: torch.Tensor,
                         ckpt_ssm: torch.Tensor) -> None:
    """Hybrid with a cache node: checkpoints travel with blocks, in a layout beside the KV one."""
    if tiers.remote is None:
        return
    geometry = StateGeometry.of(ckpt_conv, ckpt_ssm)
    tiers.remote.enable_states(checkpoint_layout(tiers.remote.layout, layer_ids, geometry), geometry)
