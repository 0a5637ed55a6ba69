"""Prefix caching for the hybrid model: which prefix of a new request is already in the cache, where its
prompt must stop so a GDN snapshot can be taken, and the bookkeeping after each step.

A hit is the longest prefix, a multiple of the block size, whose every block is cached (chained hash,
cache/prefix.py) AND that has a GDN snapshot of exactly its length (cache/snapshots.py). It is capped one
token short of the request's tokens, since the last token must run to give the logits to sample from.

Where snapshots are taken (a request's "snapshot points", chosen when it is admitted):
- the last block boundary of the prompt, floor((P-1)/B)*B: the next turn of a chat re-sends this prompt
  as its prefix, and the same prompt sent again (retries, n > 1 in sequence) hits it too;
- every `interval` tokens of a long prompt (vLLM's mamba_block_size): a prompt that shares only part of
  a long prefix still finds a snapshot at most `interval` tokens before the divergence;
- the end of the longest cached run of KV blocks, when it is longer than the hit: another request shared
  the blocks up to there, so there is a common prefix (typically a system prompt) whose end nobody
  snapshotted yet; the next request with that prefix then hits all of it.
The scheduler cuts prompt chunks at these points (clip_chunk), and after the step the slot's state is
copied into the snapshot pool.

Past its prompt's points, a request also snapshots every block boundary it reaches (during decode, or at
the end of a prompt that is a whole number of blocks), each replacing the request's previous one, so it
holds one decode snapshot at a time and leaves the last block boundary of its generated text behind when
it finishes. The next turn of a chat re-sends the prompt and this answer, so it hits up to that boundary
(at most one block short of the answer's end) instead of only up to the previous prompt's end. Earlier
boundaries are not kept: a later request reads on from the end of the answer or diverges inside the prompt
(where the prompt's own snapshots are). The cost is one slot copy per request every block_size decode
tokens, a fraction of the state traffic of those steps. With speculation a verify step moves several
tokens at once, so a decode snapshot is taken only when a step happens to end on a boundary.

Speculative decoding (MTP): the MTP layer's entry at position t reads token t+1, so the entry at a
block's last position is valid only for sequences whose next token is the same. Each cached block records
the token after it in the sequence that wrote it, and a hit uses a block only where the request's own next
token matches. Blocks are registered one step late (up to the step's context_len): the MTP entries for a
step's positions are written by the draft pass after it, which a finishing request never gets."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.cache.kv_blocks import KVBlockPool
from deltaserve.cache.prefix import BlockHash, TokenSequence, extend_block_hashes
from deltaserve.cache.snapshots import SnapshotPool


@dataclass(slots=True)
class PrefixHit:
    num_tokens: int = 0  # cached tokens reused (a multiple of the block size; 0 = no hit)
    blocks: list[int] = field(default_factory=list)  # the cached blocks holding them, in order
    snapshot_key: BlockHash | None = None  # the GDN snapshot after num_tokens tokens


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's prefix cache counters: tokens looked up at admission, and tokens found."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class PrefixCache:
    def __init__(self, blocks: KVBlockPool, snapshots: SnapshotPool, block_size: int, interval: int,
                 with_mtp: bool = False) -> None:
        if interval <= 0 or interval % block_size:
            raise ValueError(f"the snapshot interval ({interval}) must be a positive multiple of the block "
                             f"size ({block_size})")
        self.blocks = blocks
        self.snapshots = snapshots
        self.block_size = block_size
        self.interval = interval
        self.with_mtp = with_mtp
        self.stats = PrefixCacheStats()
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # blocks of the request's table already cached
        self._points: dict[str, list[int]] = {}  # snapshot points still ahead, ascending
        self._decode_snapshot: dict[str, BlockHash] = {}  # the request's latest decode snapshot, replaced next

    def _block_hashes(self, seq: TokenSequence, num_blocks: int) -> list[BlockHash]:
        return extend_block_hashes(self._hashes.setdefault(seq.request_id, []), seq, num_blocks, self.block_size)

    def _next_token(self, seq: TokenSequence, block: int) -> int | None:
        """The token after block `block` of seq, which its MTP entries depend on (None without MTP)."""
        if not self.with_mtp:
            return None
        end = (block + 1) * self.block_size
        return seq.token_slice(end, end + 1)[0]

    def lookup(self, seq: TokenSequence) -> PrefixHit:
        """The longest usable cached prefix of seq (which holds nothing yet), and its snapshot points."""
        bs = self.block_size
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // bs)
        chain: list[int] = []
        for i, h in enumerate(hashes):
            want = self._next_token(seq, i)
            block = next((c.block_id for c in self.blocks.lookup(h) if c.next_token == want), None)
            if block is None:
                break
            chain.append(block)
        hit = PrefixHit()
        for n in range(len(chain), 0, -1):
            if hashes[n - 1] in self.snapshots:
                hit = PrefixHit(n * bs, chain[:n], hashes[n - 1])
                break
        last = (seq.num_tokens - 1) // bs * bs
        points = set(range(self.interval, last + 1, self.interval)) | {last, len(chain) * bs}
        self._points[seq.request_id] = sorted(p for p in points if p > hit.num_tokens)
        return hit

    def admitted(self, seq: TokenSequence, hit: PrefixHit) -> None:
        self.stats.requests += 1
        self.stats.queries += seq.num_tokens
        self.stats.hits += hit.num_tokens
        self._num_registered[seq.request_id] = len(hit.blocks)

    def restore(self, hit: PrefixHit, slot: int) -> None:
        self.snapshots.restore(hit.snapshot_key, slot)

    def clip_chunk(self, request_id: str, start: int, num_tokens: int) -> int:
        """num_tokens from `start`, shortened to end at the request's next snapshot point if one is in it."""
        for p in self._points.get(request_id, ()):
            if p > start:
                return min(num_tokens, p - start)
        return num_tokens

    def after_step(self, entries: list[tuple[TokenSequence, int]], tables: dict[str, list[int]],
                   slots: dict[str, int]) -> None:
        """Each (seq, context_len): seq ran positions [context_len, num_computed_tokens) this step. Snapshot
        its GDN state if it stands on a snapshot point, and register its newly valid full blocks. Runs
        every step for every request, so the common case (nothing to do) is a few dict reads."""
        bs, all_points, registered = self.block_size, self._points, self._num_registered
        for seq, context_len in entries:
            rid = seq.request_id
            table = tables.get(rid)
            if table is None:  # freed since it was scheduled (aborted): nothing of it is cached
                continue
            done = seq.num_computed_tokens
            points = all_points.get(rid)
            if points and points[0] <= done:
                if points[0] == done:
                    self.snapshots.save(self._block_hashes(seq, done // bs)[done // bs - 1], slots[rid])
                while points and points[0] <= done:
                    points.pop(0)
            elif not points and done % bs == 0:  # a block boundary past the prompt's points: decode snapshot
                key = self._block_hashes(seq, done // bs)[done // bs - 1]
                if self.snapshots.save(key, slots[rid], replacing=self._decode_snapshot.get(rid)):
                    self._decode_snapshot[rid] = key
            last = (context_len if self.with_mtp else done) // bs
            first = registered.get(rid, 0)
            if last > first:
                last = min(last, len(table))
                hashes = self._block_hashes(seq, last)
                for i in range(first, last):
                    self.blocks.cache(table[i], hashes[i], self._next_token(seq, i))
                registered[rid] = last

    def forget(self, request_id: str) -> None:
        """The request left the cache (finished, aborted or preempted); its blocks stay cached."""
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._points.pop(request_id, None)
        self._decode_snapshot.pop(request_id, None)  # the snapshot itself stays, for the next turn
