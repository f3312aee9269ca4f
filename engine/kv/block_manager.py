"""Hands out fixed-size KV blocks with reference counts, and keeps full blocks cached by content.

Every block is in exactly one state: free (no holder, no content worth keeping), cached (no
holder, content known by its hash, evictable in least-recently-used order) or used (held by at
least one sequence). free + cached + used == total at all times. A fresh block comes from the
free list first and evicts the least recently used cached block only when that list is empty.
A block held by several sequences is copied before one of them writes into it (copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.core.request import Request
from engine.kv.block_hash import ROOT_HASH, extend_block_hashes, salted
from engine.kv.events import BlockStored, EventLog, external_hash
from engine.kv.residency import BlockResidency
from engine.kv.state_slots import StateSlots
from engine.kv.state_snapshots import StateSnapshots


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        # What the prefix cache stored and forgot, for routers (`events.py`); None: not kept.
        self.events: EventLog | None = None
        # How long cached blocks live, sampled (`residency.py`); None: not followed.
        self.residency: BlockResidency | None = None
        # A recurrent model's state slots, one per request holding blocks (`state_slots.py`);
        # None for models whose layers all attend.
        self.state_slots: StateSlots | None = None
        # The copies of its states that its prefix caching resumes from (`state_snapshots.py`);
        # None where it keeps none (or the model keeps no states).
        self.snapshots: StateSnapshots | None = None

    # ---- counts ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to a new allocation: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ---- prefix cache ----------------------------------------------------------------------

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the longest run of the request's leading full blocks; the
        last token is always left to compute (its logits give the next token). A request that
        wants its prompt's logprobs takes none: they come from computing every prompt token
        (as in vLLM)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            root=_root(request),
            extras=_image_starts(request),
        )
        limit = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:limit]:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def claim(self, request: Request, blocks: list[int]) -> None:
        """Give the request (holding nothing yet) a hold on cached blocks; they leave the
        eviction list."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            request.block_ids.append(block)
            if self.residency is not None:
                self.residency.hit(block)
        request.num_published_blocks = len(blocks)

    def claim_cached_prefix(self, request: Request) -> None:
        """Start a request holding no blocks from the longest cached run of its full blocks:
        it holds them and counts their tokens computed. A recurrent model's request takes the
        longest run that ends where a snapshot of the states is kept, and resumes from that
        snapshot (`request.restore_snapshot`)."""
        blocks = self.cached_prefix(request)
        if self.snapshots is not None:
            blocks, request.restore_snapshot = self._resumable(request, blocks)
        self.claim(request, blocks)
        request.num_computed_tokens = len(blocks) * self.block_size

    def _resumable(self, request: Request, blocks: list[int]) -> tuple[list[int], int | None]:
        """The longest run of `blocks` after which the states are kept, with their snapshot's
        row ([] and None where there is none)."""
        assert self.snapshots is not None
        per = self.snapshots.interval // self.block_size
        for count in range(len(blocks) // per * per, 0, -per):
            row = self.snapshots.find(request.block_hashes[count - 1])
            if row is not None:
                return blocks[:count], row
        return [], None

    def snapshot_row(self, request: Request, end: int) -> tuple[int, int] | None:
        """A snapshot row (and its generation) reserved for the request's states after its
        first `end` tokens, a step's end: where `end` is on the snapshots' grid and those states
        are not kept already; else None."""
        snapshots = self.snapshots
        if snapshots is None or end == 0 or end % snapshots.interval:
            return None
        if end <= len(request.all_token_ids):  # else its last token is still being sampled
            extend_block_hashes(
                request.block_hashes,
                request.all_token_ids,
                self.block_size,
                end,
                _root(request),
                _image_starts(request),
            )
            if snapshots.kept(request.block_hashes[end // self.block_size - 1]):
                return None
        return snapshots.reserve()

    def commit_snapshot(self, request: Request, end: int, row: tuple[int, int]) -> None:
        """Know the snapshot `row`, taken after the request's first `end` tokens by a step that
        completed, by the hash of the block that ends there (its blocks published up to `end`
        already)."""
        if self.snapshots is not None and len(request.block_hashes) >= end // self.block_size:
            block_hash = request.block_hashes[end // self.block_size - 1]
            self.snapshots.commit(*row, block_hash)

    def cache_full_blocks(self, request: Request, computed: int | None = None) -> None:
        """Publish the request's full blocks among its first `computed` tokens (default: its
        computed ones) so later prompts can reuse them. A block whose content is already
        cached elsewhere stays private."""
        if not self.enable_caching:
            return
        if computed is None or computed > request.num_computed_tokens:
            computed = request.num_computed_tokens
        full = min(computed // self.block_size, len(request.block_ids))
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            full * self.block_size,
            _root(request),
            _image_starts(request),
        )
        stored = []
        for index in range(request.num_published_blocks, full):
            block = request.block_ids[index]
            block_hash = request.block_hashes[index]
            if self._hashes[block] is None and block_hash not in self._by_hash:
                self._hashes[block] = block_hash
                self._by_hash[block_hash] = block
                stored.append(index)
        request.num_published_blocks = max(request.num_published_blocks, full)
        if self.events is not None and stored:
            self._record_stored(request, stored)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """One event per run of consecutive blocks the request has just published."""
        assert self.events is not None
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        hashes, size = request.block_hashes, self.block_size
        lora = request.lora
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.events.stored(
                BlockStored(
                    [external_hash(hashes[index]) for index in run],
                    external_hash(hashes[first - 1]) if first > 0 else None,
                    list(request.all_token_ids[first * size : end * size]),
                    size,
                    None if lora is None else lora.lora_id,
                    None if lora is None else lora.name,
                )
            )

    # ---- allocation ------------------------------------------------------------------------

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Make the request able to hold `num_tokens` tokens and to write those from its
        `num_computed_tokens` on: new blocks for growth, private copies of shared blocks in the
        write range. All or nothing; the copies to make go to `pending_copies`."""
        first = request.num_computed_tokens // self.block_size
        shared = [
            i
            for i in range(first, min(len(request.block_ids), self.blocks_for(num_tokens)))
            if self._ref_counts[request.block_ids[i]] > 1
        ]
        missing = max(0, self.blocks_for(num_tokens) - len(request.block_ids))
        if missing + len(shared) > self.num_free_blocks:
            return False
        if self.state_slots is not None and not self.state_slots.hold(request):
            return False
        for index in shared:
            source = request.block_ids[index]
            copy = self._take()
            self._ref_counts[source] -= 1
            request.block_ids[index] = copy
            self.pending_copies.append((source, copy))
        for _ in range(missing):
            request.block_ids.append(self._take())
        return True

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget_hash(block)
            if self.residency is not None:
                self.residency.evicted(block)
        self._ref_counts[block] = 1
        if self.residency is not None:
            self.residency.taken(block)
        return block

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share every block of `parent` (copied on its first write)."""
        for block in parent.block_ids:
            self._ref_counts[block] += 1
        child.block_ids = list(parent.block_ids)
        child.num_published_blocks = parent.num_published_blocks

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks. Unheld cached blocks become evictable, the
        tail first, so a prefix outlives its suffixes."""
        for block in reversed(request.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._hashes[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
                    if self.residency is not None:
                        self.residency.dropped(block)
        request.block_ids = []
        request.num_published_blocks = 0
        request.restore_snapshot = None
        if self.state_slots is not None:
            self.state_slots.release(request)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _forget_hash(self, block: int, recorded: bool = True) -> None:
        """Drop an evictable block's hash: every evictable block holds one."""
        block_hash = self._hashes[block]
        assert block_hash is not None
        del self._by_hash[block_hash]
        self._hashes[block] = None
        if self.events is not None and recorded:
            self.events.removed(external_hash(block_hash))

    def reset_cache(self) -> int:
        """Forget every cached block that nobody holds; return how many."""
        forgotten = len(self._evictable)
        # Forgetting every cached block is one event, not one per block.
        clears_all = forgotten > 0 and forgotten == len(self._by_hash)
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget_hash(block, recorded=not clears_all)
            self._free.append(block)
            if self.residency is not None:
                self.residency.dropped(block)
        if self.events is not None and clears_all:
            self.events.cleared()
        if self.snapshots is not None:
            self.snapshots.clear()
        return forgotten

    # ---- checks ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        assert all(count >= 0 for count in self._ref_counts), "negative reference count"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "block on the free list twice"
        assert not free & evictable, "block both free and cached"
        used = {b for b, count in enumerate(self._ref_counts) if count > 0}
        assert not used & (free | evictable), "held block on a free list"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "a block is lost"
        assert all(self._hashes[b] is None for b in free), "free block keeps a hash"
        assert all(self._hashes[b] is not None for b in evictable), "cached block has no hash"
        for block_hash, block in self._by_hash.items():
            assert self._hashes[block] == block_hash, "hash index out of date"
        if self.state_slots is not None:
            self.state_slots.check_invariants()
        if self.snapshots is not None:
            self.snapshots.check_invariants()


def _root(request: Request) -> bytes:
    """The parent hash of the request's first block: its LoRA adapter's, if it runs one, under
    its cache salt, if it has one."""
    root = ROOT_HASH if request.lora is None else request.lora.hash_root
    return root if request.cache_salt is None else salted(root, request.cache_salt)


def _image_starts(request: Request) -> tuple[tuple[int, bytes], ...]:
    """Where each of the prompt's images starts, with its digest (none for a text prompt)."""
    return () if request.images is None else request.images.starts
