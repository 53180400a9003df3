"""Assignment of recurrent-state slots (hybrid models) to requests.

A hybrid request's DeltaNet state lives in one slot of a fixed pool (the runner's
``StatePool``) from admission until it finishes or is preempted. The state cannot be rebuilt
from KV, so freeing a slot loses the request's progress: a preempted hybrid request is
recomputed from its first token (which the scheduler does for every preempted request).
"""

from __future__ import annotations


class StateSlotsExhausted(RuntimeError):
    """No free state slot: admit fewer requests at once (slots == max_num_seqs)."""


class StateSlots:
    """request id -> slot, over ``num_slots`` slots. Pure bookkeeping, O(1) per call.

    Invariants (``check_integrity``): a slot is owned by at most one request; free slots and
    owned slots partition ``range(num_slots)``.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int:
        """The request's slot, assigning a free one on first call."""
        slot = self._owner.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            raise StateSlotsExhausted(f"all {self.num_slots} state slots are in use; cannot admit {request_id!r}")
        slot = self._free.pop()
        self._owner[request_id] = slot
        return slot

    def slot(self, request_id: str) -> int:
        try:
            return self._owner[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no state slot (not admitted, or freed)") from None

    def owners(self) -> set[str]:
        """Ids of the requests holding a slot."""
        return set(self._owner)

    def free(self, request_id: str) -> None:
        """Give the request's slot back; unknown ids are ignored (finish after preemption)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self) -> None:
        owned = list(self._owner.values())
        if len(set(owned)) != len(owned) or set(owned) & set(self._free) or \
                sorted(owned + self._free) != list(range(self.num_slots)):
            raise AssertionError(f"state slots inconsistent: owned {sorted(owned)}, free {sorted(self._free)}")
