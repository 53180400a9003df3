"""The CacheAwareRouting condition: does the router route by prefix, as its policy says?

A prefix policy silently routing by load (no tokenizer, or engines hashing other blocks) costs
every cache hit and looks healthy from outside; this condition says so on the
InferenceDeployment. Its input is each router pod's `/ready` body (`RouterApp.readiness`):
`tokenizer` (fingerprint or None), `tokenizer_problem`, and `mismatches` (engine URL -> the
/kv/info field it disagrees on). Pure: the autoscaler loop fetches, this decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .spec import PREFIX_ROUTER_POLICIES

ROUTING = "CacheAwareRouting"


def routing_condition(policy: str, answers: Sequence[tuple[str, Mapping[str, Any] | None]],
                      previous: Mapping[str, Any] | None, now: str, generation: int) -> dict[str, Any] | None:
    """The condition for router pods' `answers` ((pod, /ready body or None)); None when the
    policy does not route by prefix (there is nothing to report)."""
    if policy not in PREFIX_ROUTER_POLICIES:
        return None
    answered = [(pod, body) for pod, body in answers if isinstance(body, Mapping) and "tokenizer" in body]
    no_tokenizer = [f"{pod}: {body.get('tokenizer_problem') or 'no tokenizer'}" for pod, body in answered
                    if not body.get("tokenizer")]
    mismatched = sorted({f"{url} differs in {field}" for _, body in answered
                         for url, field in (body.get("mismatches") or {}).items()})
    if not answered:
        value, reason, message = "Unknown", "NoRouterAnswer", "no router pod answered /ready"
    elif no_tokenizer:
        value, reason = "False", "NoTokenizer"
        message = (f"policy {policy} routes by load only: the router has no tokenizer ("
                   + "; ".join(no_tokenizer) + ")")
    elif mismatched:
        value, reason = "False", "EngineMismatch"
        message = ("engines routed by load only, never by prefix (their KV blocks hash differently): "
                   + "; ".join(mismatched))
    else:
        value, reason = "True", "PrefixRouting"
        fps = sorted({str(body["tokenizer"])[:12] for _, body in answered})
        message = f"{len(answered)} router pod(s) route by prefix (tokenizer {', '.join(fps)})"
    changed = previous is None or previous.get("status") != value
    return {"type": ROUTING, "status": value, "reason": reason, "message": message[:1024],
            "lastTransitionTime": now if changed else previous.get("lastTransitionTime", now),
            "observedGeneration": generation}
