"""weak_method: a callback that forwards while its owner lives and does not keep it alive."""

from __future__ import annotations

import gc
import weakref

from kvmesh.engine.util.weak_callback import weak_method


class Owner:
    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.hook = weak_method(self.record)  # a cycle, were the method held strongly

    def record(self, *args, **kwargs):
        self.seen.append((args, kwargs))
        return len(self.seen)


def test_forwards_arguments_and_result_while_the_owner_lives():
    owner = Owner()
    assert owner.hook(1, 2, key="v") == 1
    assert owner.seen == [((1, 2), {"key": "v"})]


def test_owner_freed_by_reference_counting_and_hook_then_does_nothing():
    gc.disable()  # freed without the cycle collector, or not at all
    try:
        owner = Owner()
        hook, ref = owner.hook, weakref.ref(owner)
        del owner
        assert ref() is None
        assert hook("late") is None
    finally:
        gc.enable()
