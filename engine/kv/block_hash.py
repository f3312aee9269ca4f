"""Content hashes of full KV blocks, chained so equal hashes mean equal whole prefixes.

Each block's hash is SHA-256 over its parent block's hash and its own token ids. Two different
prefixes share a hash only through a SHA-256 collision (about 2^-128 for any pair), so a cache
hit can be trusted without comparing tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b""


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    num_tokens: int | None = None,
    root: bytes = ROOT_HASH,
) -> None:
    """Append the hashes of every full block among the first `num_tokens` of `token_ids`
    (default: all of them) not hashed yet; the first block's parent is `root` (a LoRA
    adapter's own, so its blocks never match the base model's)."""
    limit = len(token_ids) if num_tokens is None else num_tokens
    for index in range(len(hashes), limit // block_size):
        parent = hashes[-1] if hashes else root
        start = index * block_size
        hashes.append(hash_block(parent, token_ids[start : start + block_size]))
