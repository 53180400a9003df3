"""The router's tokenizer taken from the engines it routes to (``GET /kv/tokenizer``).

A prefix-aware policy needs the engines' exact tokenizer: a router that cannot read the model
(under the operator, a Volume or URI model is mounted by the engine pods only) asks a healthy
engine for it instead of routing by load without saying so. The files travel as the engine's
``Tokenizer.to_payload`` and are rebuilt by ``Tokenizer.from_payload``; the rebuilt tokenizer's
fingerprint must equal the one the engine announced, or it is refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
import aiohttp

from kvmesh.engine.model.tokenizer import Tokenizer, TokenizerLoadError

log = logging.getLogger("kvmesh.router")


class TokenizerFetchError(RuntimeError):
    """No engine gave a usable tokenizer; the message says what each one answered."""


async def fetch_tokenizer(session: aiohttp.ClientSession, urls: Iterable[str],
                          timeout_s: float = 30.0) -> tuple[Tokenizer, str]:
    """(the tokenizer, the engine URL it came from) from the first of ``urls`` that gives one."""
    tried = []
    for url in urls:
        try:
            async with session.get(url + "/kv/tokenizer", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    tried.append(f"{url}: HTTP {r.status}")
                    continue
                payload = await r.json(content_type=None)
            # Loading takes a fraction of a second of Rust work: off the event loop.
            return await asyncio.to_thread(Tokenizer.from_payload, payload), url
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TokenizerLoadError) as e:
            tried.append(f"{url}: {type(e).__name__}: {e}")
    raise TokenizerFetchError("no engine gave its tokenizer (" + ("; ".join(tried) or "no healthy engine") + ")")
