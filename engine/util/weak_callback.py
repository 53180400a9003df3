"""Callbacks into an owner that do not keep the owner alive."""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) as a callable that holds its object weakly: it calls the method while the
    object lives and returns None once it is gone.

    An owner that hands its components callbacks into itself (a KV pool's eviction hook, a role's
    step-thread hook) would otherwise form a reference cycle through each of them, and the owner,
    with every buffer it holds, would outlive its last outside reference until the cycle collector
    next runs."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    call.__qualname__ = f"weak_method({getattr(method, '__qualname__', method)})"
    return call
