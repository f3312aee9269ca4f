"""The slots of the per-request state cache a recurrent layer keeps (a short convolution's last
inputs, a linear attention's state), handed out beside the KV blocks. Imports no torch.

A request holds one slot from its first allocation until its blocks are freed (it finishes, or
is preempted to be recomputed); a request paused with its blocks keeps its slot and resumes with
its state. A slot's state starts from zeros at a request's first token (`StateCache.begin`).
A step that verifies drafts borrows free slots for the states of its rows after each request's
first (`lend`), given back before the next step is scheduled (`take_back`).
"""

from __future__ import annotations

from collections import deque

from engine.core.request import Request


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a recurrent model needs at least one state slot")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def hold(self, request: Request) -> bool:
        """Give `request` a slot if it holds none; False where none is free."""
        if request.state_slot is not None:
            return True
        if not self._free:
            return False
        request.state_slot = self._free.popleft()
        return True

    def lend(self, count: int) -> list[int]:
        """Up to `count` free slots, for one step's use."""
        return [self._free.popleft() for _ in range(min(count, len(self._free)))]

    def take_back(self, slots: list[int]) -> None:
        """Free the slots `lend` gave."""
        self._free.extend(slots)

    def release(self, request: Request) -> None:
        """Take back the request's slot, if it holds one."""
        if request.state_slot is not None:
            self._free.append(request.state_slot)
            request.state_slot = None

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free), "state slot on the free list twice"
        assert all(0 <= slot < self.num_slots for slot in self._free), "state slot out of range"
