"""Prefix hashing: every full block of a sequence is named by a chained hash of its tokens.

hash(block i) = sha256(hash(block i-1) | token ids of block i | extra keys). The chain makes a block's
hash stand for the whole prefix up to its end, so two sequences share a block only when every token
before it is the same too. Extra keys (the request's cache_salt, on the first block; the content hash of
every image a block holds placeholder tokens of) keep prefixes that read the same ids but must not be
shared apart.

A hit is decided by the hash alone (no comparison of token ids): sha256 is strong enough that a
collision is impractical, as in vLLM's `prefix_caching_hash_algo="sha256"`."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Protocol

BlockHash = bytes


class TokenSequence(Protocol):
    """What the cache needs to know of a request (engine.request.Request satisfies it)."""

    request_id: str
    cache_salt: str | None
    num_computed_tokens: int
    image_spans: list[tuple[int, int, str]]  # (first token, end, content hash) of each image's placeholders

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())  # fixed-width ids: [1, 23] and [12, 3] differ
    for key in extra_keys:
        data = key.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], seq: TokenSequence, num_blocks: int, block_size: int
) -> list[BlockHash]:
    """Grow `hashes` (seq's block hashes so far) in place to cover its first num_blocks full blocks."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        tokens = seq.token_slice(i * block_size, (i + 1) * block_size)
        extra = (seq.cache_salt,) if i == 0 and seq.cache_salt is not None else ()
        lo, hi = i * block_size, (i + 1) * block_size
        extra += tuple(h for start, end, h in seq.image_spans if start < hi and end > lo)
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens, extra))
    return hashes
