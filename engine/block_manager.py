"""Hands out fixed-size KV blocks from a free list, with reference counts."""

from __future__ import annotations

from collections import deque

from engine.request import Request


class BlockManager:
    """Owns the block ids of the paged KV cache.

    Invariant: every block is either on the free list (reference count 0) or held by at least one
    sequence, so free + used == total at all times.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` tokens; all or nothing."""
        missing = self.blocks_for(num_tokens) - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        for _ in range(missing):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks; blocks nobody holds return to the pool."""
        for block in reversed(request.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        request.block_ids = []

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        assert all(count >= 0 for count in self._ref_counts), "negative reference count"
        free = set(self._free)
        assert len(free) == len(self._free), "block on the free list twice"
        for block, count in enumerate(self._ref_counts):
            assert (count == 0) == (block in free), f"block {block} free state disagrees"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
