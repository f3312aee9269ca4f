"""Which copies of requests' recurrent states are kept for prefix caching. Imports no torch.

A model whose layers keep recurrent states cannot resume a cached prefix from its K/V alone: it
needs each layer's state after that prefix too. So every `interval` tokens (a multiple of the
block size) a request's states are copied, after the step that ends there, into one of `count`
snapshot rows (`StateCache.snapshots`), known by the hash of the block that ends there; a later
request whose leading blocks are cached resumes from the longest run of them that ends at a
kept snapshot, its states copied from it (`BlockManager.cached_prefix`). Rows are reused least
recently used first.

A row is reserved when the step that fills it is scheduled, and known by its hash only once that
step's results arrive (`commit`): a step that fails, or whose request ends meanwhile, leaves no
row known by states it may not have finished. A row reserved again before its first reservation
is committed (its generation moved on) holds the later states, and the first commit is dropped.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, count: int, interval: int) -> None:
        if count < 1 or interval < 1:
            raise ValueError("state snapshots need a positive count and interval")
        self.count = count
        self.interval = interval
        # Every row, least recently used first.
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(range(count))
        self._hash_of: list[bytes | None] = [None] * count
        self._row_of: dict[bytes, int] = {}
        self._generation = [0] * count

    @property
    def num_kept(self) -> int:
        """Rows known by a hash."""
        return len(self._row_of)

    def kept(self, block_hash: bytes) -> bool:
        return block_hash in self._row_of

    def find(self, block_hash: bytes) -> int | None:
        """The row of the states after the block `block_hash`, now the most recently used; None
        where none is kept."""
        row = self._row_of.get(block_hash)
        if row is not None:
            self._order.move_to_end(row)
        return row

    def reserve(self) -> tuple[int, int]:
        """The least recently used row, forgotten, for states a scheduled step will copy in; with
        the generation its commit names."""
        row, _ = self._order.popitem(last=False)
        self._order[row] = None
        self._forget(row)
        self._generation[row] += 1
        return row, self._generation[row]

    def commit(self, row: int, generation: int, block_hash: bytes) -> None:
        """Know `row`, filled by a step that completed, by `block_hash` from now on; unless it
        was reserved again since, or those states are kept in another row already."""
        if self._generation[row] != generation or block_hash in self._row_of:
            return
        self._hash_of[row] = block_hash
        self._row_of[block_hash] = row

    def clear(self) -> int:
        """Forget every kept snapshot; return how many."""
        forgotten = len(self._row_of)
        for row in range(self.count):
            self._forget(row)
        return forgotten

    def _forget(self, row: int) -> None:
        block_hash = self._hash_of[row]
        if block_hash is not None:
            del self._row_of[block_hash]
            self._hash_of[row] = None

    def check_invariants(self) -> None:
        assert len(self._order) == self.count, "a snapshot row is lost"
        for block_hash, row in self._row_of.items():
            assert self._hash_of[row] == block_hash, "snapshot index out of date"
        assert sum(h is not None for h in self._hash_of) == len(self._row_of)
