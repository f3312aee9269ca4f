"""Suffix decoding (vLLM's `suffix` method, after Arctic Inference's): drafts from the
continuations that most often followed the sequence's latest tokens, in its own prompt and
output or in the outputs of earlier requests, with as many tokens as the match and their
estimated chance allow.

Each source counts, for every string of up to `depth` tokens, how often it occurred. From the
longest suffix of the sequence (under `depth` tokens) that occurred, and from each shorter one,
a walk follows the most frequent next token (the lowest id of equally frequent ones); a token's
estimated chance is the product of each step's share (how often the longer string occurred
over how often the shorter did), and the walk stops before one under `min_token_prob`, after
`factor x` the match's length, or at `depth` tokens with the match. The draft whose chances sum
highest wins. A request's own tokens are searched by where each token occurs
(`SequenceSource`); the outputs of up to `max_cached_requests` requests, finished or running,
share one counting tree (`ResponseTree`), the oldest leaving first.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

# A request's own tokens count over the latest occurrences of its last token, at most this many
# (a long prompt that repeats itself would otherwise cost a pass over each a step).
RECENT_OCCURRENCES = 256

# A ceiling of our own on the shared tree's nodes (about 150 bytes each): where responses would
# pass it, the oldest leave, as they do past `max_cached_requests`.
MAX_TREE_NODES = 1_000_000


@dataclass(slots=True)
class SuffixDraft:
    """Drafted tokens, each one's estimated chance, and their sum (the draft's score)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0


@dataclass(frozen=True, slots=True)
class DraftRule:
    """How far a draft goes: `most` tokens, `factor` x the match's length, `depth` tokens with
    the match, and while its estimated chance stays at least `min_prob`."""

    depth: int
    factor: float
    min_prob: float

    def limit(self, match_len: int, most: int) -> int:
        """The most tokens a draft after a match of `match_len` tokens may have."""
        by_match = int(match_len * self.factor + 1e-6)
        return max(0, min(most, by_match, self.depth - match_len))


State = TypeVar("State")


def follow(
    state: State,
    occurrences: int,
    best_child: Callable[[State], tuple[int, int, State] | None],
    most: int,
    min_prob: float,
) -> SuffixDraft:
    """The draft that follows the most frequent next token from `state` (a string occurring
    `occurrences` times), up to `most` tokens, while its estimated chance stays at least
    `min_prob`. `best_child` gives a state's most frequent next token, how often the string
    with it occurred, and its state (None where nothing followed)."""
    draft = SuffixDraft()
    prob = 1.0
    while len(draft.tokens) < most:
        child = best_child(state)
        if child is None:
            break
        token, count, state = child
        prob *= count / occurrences
        if prob < min_prob:
            break
        draft.tokens.append(token)
        draft.probs.append(prob)
        draft.score += prob
        occurrences = count
    return draft


def best_of(
    match_lens: Sequence[int],
    walk: Callable[[int, int], SuffixDraft],
    rule: DraftRule,
    most: int,
) -> SuffixDraft:
    """The highest-scoring draft among walks after matches of each of `match_lens` (ascending;
    `walk(i, keep)` walks at least `keep` tokens after the i-th where it can), each cut to what
    its match allows; a longer match wins a tie. Longest first, a match whose whole allowance
    could not beat the best so far is not walked (each token's chance is at most 1)."""
    best = SuffixDraft()
    for i in range(len(match_lens) - 1, -1, -1):
        keep = rule.limit(match_lens[i], most)
        if keep <= best.score:
            continue
        found = walk(i, keep)
        score = sum(found.probs[:keep])
        if score > best.score:
            best = SuffixDraft(found.tokens[:keep], found.probs[:keep], score)
    return best


class SequenceSource:
    """One sequence's own tokens (prompt and output so far), searched by where each token
    occurs: the ends of a suffix's occurrences (among the latest `RECENT_OCCURRENCES` of its
    last token) narrow as the suffix grows, and a draft follows the next tokens after them."""

    def __init__(self) -> None:
        self._where: dict[int, list[int]] = {}
        self._indexed = 0

    def draft(self, tokens: Sequence[int], rule: DraftRule, most: int) -> SuffixDraft:
        """The best draft to follow `tokens` from the sequence itself (`tokens` is the whole
        sequence, grown since the last call)."""
        self._catch_up(tokens)
        length = len(tokens)
        context = min(length, rule.depth)
        if context < 2 or most <= 0:
            return SuffixDraft()
        # The ends of each suffix's occurrences; suffixes with as many share them (and walks).
        ends = self._where[tokens[-1]][-RECENT_OCCURRENCES:]
        groups: list[list[int]] = []  # distinct lists of ends, fewer and fewer
        group_of: list[int] = []  # each match length's
        first_of: list[int] = []  # each group's shortest match length
        for match_len in range(1, context):
            if match_len > 1:
                before = tokens[length - match_len]
                ends = [
                    e for e in ends if e >= match_len - 1 and tokens[e - match_len + 1] == before
                ]
            if not groups or len(ends) != len(groups[-1]):
                groups.append(ends)
                first_of.append(match_len)
            group_of.append(len(groups) - 1)
        walks: dict[int, SuffixDraft] = {}

        def walk(i: int, keep: int) -> SuffixDraft:
            group = group_of[i]
            if group not in walks:
                # Long enough for every match length of the group.
                longest = min(most, rule.depth - first_of[group])
                walks[group] = self._walk(tokens, groups[group], rule, longest)
            return walks[group]

        return best_of(range(1, context), walk, rule, most)

    @staticmethod
    def _walk(tokens: Sequence[int], ends: list[int], rule: DraftRule, most: int) -> SuffixDraft:
        """The draft that follows the occurrences ending at `ends`."""
        last = len(tokens) - 1

        def best_child(ends: list[int]) -> tuple[int, int, list[int]] | None:
            counts: dict[int, int] = {}
            for end in ends:
                if end < last:
                    token = tokens[end + 1]
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                return None
            token = min(counts, key=lambda t: (-counts[t], t))
            return (
                token,
                counts[token],
                [e + 1 for e in ends if e < last and tokens[e + 1] == token],
            )

        return follow(ends, len(ends), best_child, most, rule.min_prob)

    def _catch_up(self, tokens: Sequence[int]) -> None:
        where = self._where
        for position in range(self._indexed, len(tokens)):
            where.setdefault(tokens[position], []).append(position)
        self._indexed = len(tokens)


class ResponseTree:
    """The outputs of many sequences in one tree that counts how often each string of up to
    `depth` tokens occurred among them: each node is such a string, a child one more token.
    Kept in flat arrays, each node's children in a doubly linked list (the newest first)."""

    ROOT = 0
    STALE = -2

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._child: dict[int, int] = {}  # node << 32 | token -> child node
        self._count = array("q", [0])
        self._token = array("q", [-1])
        self._first = array("q", [-1])
        self._next = array("q", [-1])
        self._prev = array("q", [-1])
        # Each node's most frequent child (-1: none; STALE: to be found again).
        self._best = array("q", [-1])
        self._free: list[int] = []
        # Counts up whenever nodes may have been freed (their numbers are reused).
        self.version = 0
        self.nodes = 1  # the root
        self._tokens: dict[int, list[int]] = {}
        # Each sequence's open suffixes: the nodes of its last `depth - 1` .. 0 tokens (the
        # longest first).
        self._open: dict[int, list[int]] = {}

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq` (a new one where it has none yet)."""
        own = self._tokens.setdefault(seq, [])
        opened = self._open.setdefault(seq, [])
        count, best, children = self._count, self._best, self._child
        for token in tokens:
            opened.append(self.ROOT)
            if len(opened) > self.depth:
                del opened[0]
            count[self.ROOT] += 1
            new = False  # shortest suffix first: once one never went on so, no longer one did
            for i in range(len(opened) - 1, -1, -1):
                node = opened[i]
                child = None if new else children.get(node << 32 | token)
                if child is None:
                    child, new = self._new_node(node, token), True
                count[child] += 1
                leader = best[node]
                if leader == -1 or (leader >= 0 and leader != child and self._leads(child, leader)):
                    best[node] = child
                opened[i] = child
            own.append(token)

    def remove(self, seq: int) -> None:
        """Take sequence `seq` out of the counts (each of its suffixes, `depth` tokens long at
        most), freeing the nodes no other sequence passes through."""
        tokens = self._tokens.pop(seq)
        del self._open[seq]
        self.version += 1
        count, best = self._count, self._best
        for start in range(len(tokens)):
            count[self.ROOT] -= 1
            node = self.ROOT
            for token in tokens[start : start + self.depth]:
                child = self._child[node << 32 | token]
                count[child] -= 1
                if best[node] == child:
                    best[node] = self.STALE
                if count[child] == 0:
                    self._drop(node, child)
                    break
                node = child

    def draft(
        self,
        context: Sequence[int],
        rule: DraftRule,
        most: int,
        matches: list[int] | None = None,
    ) -> SuffixDraft:
        """The best draft to follow `context` (a sequence's last tokens) from the outputs;
        `matches`, where given, holds the nodes of its suffixes that occurred (as `matches`
        finds them)."""
        found = matches if matches is not None else self.matches(context)

        def walk(i: int, keep: int) -> SuffixDraft:
            node = found[i]
            return follow(node, self._count[node], self._best_child, keep, rule.min_prob)

        return best_of(range(1, len(found) + 1), walk, rule, most)

    def matches(self, context: Sequence[int], known: list[int] | None = None) -> list[int]:
        """The nodes of `context`'s suffixes that occurred, shortest first, up to one token
        shorter than `context` (at most `depth` tokens of it); `known` holds those of a suffix
        of it found before (where they are still valid), from which the search goes on."""
        context = context[-self.depth :]
        found = known if known is not None else []
        while len(found) < len(context) - 1:
            node = self._match(context[len(context) - len(found) - 1 :])
            if node is None:
                break
            found.append(node)
        return found

    def follow_token(self, matches: list[int], token: int) -> list[int]:
        """The suffixes' nodes one token later: each found suffix followed by `token` (the
        first that never occurred ends the list; longer ones never did either)."""
        grown = []
        for node in (self.ROOT, *matches[: self.depth - 2]):
            child = self._child.get(node << 32 | token)
            if child is None:
                break
            grown.append(child)
        return grown

    def _match(self, tokens: Sequence[int]) -> int | None:
        node = self.ROOT
        for token in tokens:
            child = self._child.get(node << 32 | token)
            if child is None:
                return None
            node = child
        return node

    def _best_child(self, node: int) -> tuple[int, int, int] | None:
        best = self._best[node]
        if best == self.STALE:
            best = -1
            child = self._first[node]
            while child >= 0:
                if best < 0 or self._leads(child, best):
                    best = child
                child = self._next[child]
            self._best[node] = best
        if best < 0:
            return None
        return self._token[best], self._count[best], best

    def _leads(self, child: int, other: int) -> bool:
        """Whether `child` comes before `other` as a draft's next token: more frequent, or as
        frequent with a lower id."""
        count, rival = self._count[child], self._count[other]
        return count > rival or (count == rival and self._token[child] < self._token[other])

    def _new_node(self, parent: int, token: int) -> int:
        first, nxt, prev = self._first, self._next, self._prev
        head = first[parent]
        if self._free:
            node = self._free.pop()
            self._count[node] = 0
            self._token[node] = token
            first[node] = self._best[node] = -1
            nxt[node], prev[node] = head, -1
        else:
            node = len(first)
            self._count.append(0)
            self._token.append(token)
            first.append(-1)
            self._best.append(-1)
            nxt.append(head)
            prev.append(-1)
        if head >= 0:
            prev[head] = node
        first[parent] = node
        self._child[parent << 32 | token] = node
        self.nodes += 1
        return node

    def _drop(self, parent: int, node: int) -> None:
        """Free `node` and the nodes under it (all at a count of 0: one chain)."""
        nxt, prev = self._next[node], self._prev[node]
        if prev >= 0:
            self._next[prev] = nxt
        else:
            self._first[parent] = nxt
        if nxt >= 0:
            self._prev[nxt] = prev
        while node >= 0:
            del self._child[parent << 32 | self._token[node]]
            self._free.append(node)
            self.nodes -= 1
            parent, node = node, self._first[node]


@dataclass(frozen=True, slots=True)
class SuffixSettings:
    """vLLM's `suffix_decoding_*` fields: the trees' `depth`, how many requests' outputs stay
    cached (0: none, a request drafts from itself only; -1: no limit), and the draft rule's
    factor and least estimated chance."""

    depth: int = 24
    max_cached_requests: int = 10_000
    factor: float = 1.0
    min_prob: float = 0.1

    @property
    def rule(self) -> DraftRule:
        return DraftRule(self.depth, self.factor, self.min_prob)


class SuffixCache:
    """Each running request's own source and the shared tree of outputs: a request's output
    enters the tree as it grows (where outputs are cached) and stays after the request ends,
    until `max_cached_requests` newer ones (or the node ceiling) push it out."""

    def __init__(self, settings: SuffixSettings, max_nodes: int = MAX_TREE_NODES) -> None:
        self.settings = settings
        self.max_nodes = max_nodes
        self.tree = ResponseTree(settings.depth)
        self._sources: dict[str, SequenceSource] = {}
        self._fed: dict[str, int] = {}  # output tokens of each running request in the tree
        # Each running request's tree nodes at its last draft: (tree version, tokens, nodes).
        self._cursors: dict[str, tuple[int, int, list[int]]] = {}
        self._seqs: dict[str, int] = {}  # cached requests (oldest first) -> sequence number
        self._next_seq = 0

    def observe(self, request_id: str, output: Sequence[int]) -> None:
        """A running request's output is now `output`: the tree takes its new tokens."""
        if request_id not in self._fed:
            self._fed[request_id] = 0
            self._sources[request_id] = SequenceSource()
            if request_id in self._seqs:  # a reused id: its old output leaves
                self.tree.remove(self._seqs.pop(request_id))
            if self.settings.max_cached_requests != 0:
                self._cache(request_id)
        fed = self._fed[request_id]
        if len(output) > fed:
            seq = self._seqs.get(request_id)
            if seq is not None:
                self.tree.extend(seq, output[fed:])
                self._evict(keep=seq)
            self._fed[request_id] = len(output)

    def draft(self, request_id: str, tokens: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens to follow the request's `tokens` (prompt and output)."""
        return self.best(request_id, tokens, most).tokens

    def best(self, request_id: str, tokens: Sequence[int], most: int) -> SuffixDraft:
        """The draft of up to `most` tokens to follow the request's `tokens`: its own source's,
        or the outputs' where that scores higher (its score is the tokens it is expected to
        keep)."""
        rule = self.settings.rule
        draft = self._sources[request_id].draft(tokens, rule, most)
        if self._seqs:
            shared = self.tree.draft(tokens, rule, most, self._matches(request_id, tokens))
            if shared.score > draft.score:
                draft = shared
        return draft

    def _matches(self, request_id: str, tokens: Sequence[int]) -> list[int]:
        """The tree's nodes of the request's suffixes that occurred: those of its last call
        followed by the tokens since, where no node was freed in between and few came."""
        tree = self.tree
        version, seen, matches = self._cursors.get(request_id, (-1, 0, []))
        if version != tree.version or not 0 <= len(tokens) - seen <= tree.depth:
            matches = tree.matches(tokens)
        else:
            for token in tokens[seen:]:
                matches = tree.follow_token(matches, token)
            matches = tree.matches(tokens, matches)
        self._cursors[request_id] = (tree.version, len(tokens), matches)
        return matches

    def stop(self, request_id: str) -> None:
        """The request ended: its own source goes, its output stays cached."""
        self._sources.pop(request_id, None)
        self._fed.pop(request_id, None)
        self._cursors.pop(request_id, None)

    @property
    def cached_requests(self) -> list[str]:
        return list(self._seqs)

    def _cache(self, request_id: str) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._seqs[request_id] = seq
        self.tree.extend(seq, [])
        self._evict(keep=seq)

    def _evict(self, keep: int) -> None:
        """The oldest outputs leave while more are cached than allowed or the tree is past its
        node ceiling (never the one being written, `keep`)."""
        limit = self.settings.max_cached_requests
        while (limit > 0 and len(self._seqs) > limit) or self.tree.nodes > self.max_nodes:
            oldest = next((r for r, seq in self._seqs.items() if seq != keep), None)
            if oldest is None:
                break
            self.tree.remove(self._seqs.pop(oldest))
