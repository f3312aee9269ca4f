"""Content hashes of full KV blocks, chained so equal hashes mean equal whole prefixes.

Each block's hash is SHA-256 over its parent block's hash and its own token ids, and over the
digest of each image whose placeholder tokens start in it (the tokens alone do not tell one
image from another; through the chain, every later block depends on the image too). Two
different prefixes share a hash only through a SHA-256 collision (about 2^-128 for any pair), so
a cache hit can be trusted without comparing tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b""


def hash_block(parent: bytes, token_ids: Sequence[int], extras: Sequence[bytes] = ()) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    for extra in extras:
        digest.update(extra)
    return digest.digest()


def salted(root: bytes, salt: str) -> bytes:
    """The first block's parent hash under a cache salt: prompts under another salt, or none,
    never reach the same blocks, so one tenant cannot learn from cache hits what another sent."""
    return hashlib.sha256(root + b"\0cache_salt\0" + salt.encode()).digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    num_tokens: int | None = None,
    root: bytes = ROOT_HASH,
    extras: Sequence[tuple[int, bytes]] = (),
) -> None:
    """Append the hashes of every full block among the first `num_tokens` of `token_ids`
    (default: all of them) not hashed yet; the first block's parent is `root` (a LoRA
    adapter's own, so its blocks never match the base model's). `extras` are (position,
    digest) of the prompt's images: a block hashes the digests of those starting in it."""
    limit = len(token_ids) if num_tokens is None else num_tokens
    for index in range(len(hashes), limit // block_size):
        parent = hashes[-1] if hashes else root
        start = index * block_size
        end = start + block_size
        inside = [digest for position, digest in extras if start <= position < end]
        hashes.append(hash_block(parent, token_ids[start:end], inside))
