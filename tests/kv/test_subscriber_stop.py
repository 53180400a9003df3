"""``KVEventSubscriber.stop`` ends ``run`` even when the follower swallows a cancellation, as
Python 3.11's ``asyncio.wait_for`` can when the cancel lands as its inner future completes (seen as
a hung stop in tests/kv/test_fuzz_events.py). Real: the subscriber's lifecycle code; the follower is
replaced by one that swallows the first cancel deterministically."""

import asyncio

from kvmesh.engine.kv.event_subscriber import KVEventSubscriber


def test_stop_ends_run_even_if_the_follower_swallows_a_cancel():
    swallowed = []

    async def follower() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.append(True)  # what wait_for may do on 3.11: carry on as if not cancelled
        await asyncio.Event().wait()

    async def main() -> None:
        sub = KVEventSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "http://127.0.0.1:3/kv/snapshot",
                                lambda *a: None, lambda snap: None)
        sub._follow = follower  # the real one needs a publisher; the lifecycle is what is tested
        task = asyncio.ensure_future(sub.run())
        await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(sub.stop())
        # asyncio.wait, not wait_for: the latter shares the very bug (it would end a hung stop by
        # cancelling it again, and return as if it had finished).
        done, _ = await asyncio.wait({stopping, task}, timeout=5)
        assert done == {stopping, task}, "stop() did not end run()"
        for t in (stopping, task):
            if not t.done():
                t.cancel()

    asyncio.run(main())
    assert swallowed == [True]
