"""The parts of prefix caching on their own: chained block hashes, the ref-counted KV block pool with its
LRU of freed cached blocks, and the GDN snapshot pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from deltaserve.cache.block_pool import CacheExhaustedError
from deltaserve.cache.kv_blocks import KVBlockPool
from deltaserve.cache.prefix import extend_block_hashes, hash_block
from deltaserve.cache.snapshots import SnapshotPool, SnapshotStore
from deltaserve.model.context import CacheTensors


@dataclass
class Seq:
    tokens: list[int]
    cache_salt: str | None = None
    request_id: str = "r"
    num_computed_tokens: int = 0
    image_spans: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def _hashes(tokens: list[int], salt: str | None = None, n: int = 3) -> list[bytes]:
    return extend_block_hashes([], Seq(tokens, salt), n, 4)


def test_block_hash_chains_over_the_whole_prefix() -> None:
    a = _hashes(list(range(12)))
    assert len(a) == 3 and all(len(h) == 32 for h in a)  # sha256 digests
    assert _hashes(list(range(12))) == a  # deterministic
    b = _hashes([99] + list(range(1, 12)))  # differs in block 0 only: every later hash differs too
    assert all(x != y for x, y in zip(a, b, strict=True))
    c = _hashes(list(range(8)) + [0, 9, 10, 11])
    assert c[:2] == a[:2] and c[2] != a[2]
    salted = _hashes(list(range(12)), "alice")
    assert all(x != y for x, y in zip(a, salted, strict=True)) and salted == _hashes(list(range(12)), "alice")
    assert _hashes(list(range(12)), "bob") != salted
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])  # ids are fixed width, not concatenated digits
    seq = Seq(list(range(10)))
    hashes = extend_block_hashes([], seq, 1, 4)
    assert extend_block_hashes(hashes, seq, 2, 4) is hashes and hashes == _hashes(list(range(10)), n=2)


def test_kv_pool_ref_counts_and_lru_of_freed_cached_blocks() -> None:
    pool = KVBlockPool(4)
    a = pool.allocate(2)
    for i, b in enumerate(a):
        pool.cache(b, bytes([i]) * 32, None)
    pool.touch(a)  # a second request shares both
    assert pool.ref_counts[a[0]] == 2 and pool.num_shared == 2 and pool.num_free == 2
    pool.free(a)
    assert pool.num_free == 2 and pool.num_cached == 2  # still held once
    pool.free(a)
    assert pool.num_free == 4 and pool.num_cached == 2  # cached and free: in the LRU queue
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a[:1])
    assert pool.num_reclaimed_by(a) == 2
    pool.touch([a[0]])  # a hit takes a free cached block back
    assert pool.num_free == 3 and [c.block_id for c in pool.lookup(bytes([0]) * 32)] == [a[0]]
    pool.free([a[0]])
    # Plain blocks go first; then the least recently freed cached one: a[1] (the tail was queued first).
    plain = pool.allocate(2)
    assert not set(plain) & set(a) and pool.num_evicted == 0
    assert pool.allocate(1) == [a[1]] and pool.num_evicted == 1 and not pool.lookup(bytes([1]) * 32)
    assert pool.lookup(bytes([0]) * 32)
    with pytest.raises(CacheExhaustedError):
        pool.allocate(2)


def test_kv_pool_keeps_one_block_per_hash_and_next_token() -> None:
    pool = KVBlockPool(3)
    x, y, z = pool.allocate(3)
    h = b"h" * 32
    pool.cache(x, h, 5)
    pool.cache(y, h, 5)  # a copy: stays plain
    pool.cache(z, h, 6)  # another next token: the MTP entry differs, so it is kept
    assert sorted((c.block_id, c.next_token) for c in pool.lookup(h)) == [(x, 5), (z, 6)]
    pool.free([x, y, z])
    assert pool.num_cached == 2 and pool.num_free == 3


def _cache(slots: int) -> CacheTensors:
    g = torch.Generator().manual_seed(0)
    conv = {i: torch.randn(slots, 6, 3, generator=g) for i in (0, 2)}
    ssm = {i: torch.randn(slots, 2, 4, 5, generator=g) for i in (0, 2)}
    return CacheTensors(kv={}, conv=conv, ssm=ssm)


def test_snapshot_pool_saves_restores_and_evicts_least_recently_used() -> None:
    cache = _cache(3)
    pool = SnapshotPool(SnapshotStore(cache, 2))
    assert pool.bytes_per_snapshot == 2 * (6 * 3 + 2 * 4 * 5) * 4
    want0 = {i: (cache.conv[i][0].clone(), cache.ssm[i][0].clone()) for i in (0, 2)}
    pool.save(b"a", 0)
    pool.save(b"b", 1)
    cache.conv[0][0].zero_()  # the slot moves on; the snapshot keeps what it was
    pool.restore(b"a", 2)  # also marks "a" used, so "b" is the one evicted next
    for i in (0, 2):
        assert torch.equal(cache.conv[i][2], want0[i][0]) and torch.equal(cache.ssm[i][2], want0[i][1])
    pool.save(b"c", 1)
    assert b"a" in pool and b"b" not in pool and b"c" in pool and pool.num_evicted == 1
    assert pool.num_used == 2 and pool.bytes_used == 2 * pool.bytes_per_snapshot
    pool.save(b"c", 0)  # already held: nothing copied
    assert pool.num_saved == 3


def test_another_rank_replays_the_drivers_snapshot_copies() -> None:
    """Tensor parallelism: the driver's pool picks the entries and its store logs each copy; a worker's
    store (its own states, here other values) replays them in order and ends as the driver's would."""
    driver, worker = _cache(3), _cache(3)
    for t in list(worker.conv.values()) + list(worker.ssm.values()):
        t.mul_(-2)  # a rank's states differ from rank 0's (other value heads)
    want = {i: (worker.conv[i][0].clone(), worker.ssm[i][0].clone()) for i in (0, 2)}
    store, replica = SnapshotStore(driver, 1), SnapshotStore(worker, 1)
    store.copies = []
    pool = SnapshotPool(store)
    pool.save(b"a", 0)
    pool.restore(b"a", 2)
    pool.save(b"b", 1)  # evicts "a": the one entry now holds slot 1's states
    copies = store.take_copies()
    assert copies.tolist() == [[0, 0, 0], [1, 0, 2], [0, 0, 1]] and store.copies == []
    replica.apply(copies)
    for i in (0, 2):
        assert torch.equal(worker.conv[i][2], want[i][0]) and torch.equal(worker.ssm[i][2], want[i][1])
        assert torch.equal(replica.conv[i][0], worker.conv[i][1])
    assert replica.copies is None  # a worker logs nothing


def test_plan_counts_the_snapshot_pool(capsys: pytest.CaptureFixture[str]) -> None:
    from deltaserve.cli_plan import main as plan_main
    from deltaserve.config import ModelConfig
    from deltaserve.engine.known_configs import known_config
    from deltaserve.engine.planner import plan_memory

    cfg = ModelConfig.from_dict(known_config("qwen3.5-27b"))
    plain = plan_memory(cfg, 8192, 8, tp=4)
    cached = plan_memory(cfg, 8192, 8, tp=4, num_gdn_snapshots=32)
    assert cached.gdn_snapshot_bytes == 32 * plain.gdn_state_bytes_per_seq
    assert cached.total_bytes - plain.total_bytes == cached.gdn_snapshot_bytes
    args = ["plan", "--model", "qwen3.5-27b", "--max-model-len", "8192", "--max-num-seqs", "8", "--tp", "4"]
    assert plan_main(args) == 0  # on by default, as in the engine
    assert "(32 snapshots of one slot each)" in capsys.readouterr().out
    assert plan_main(args + ["--num-gdn-snapshots", "5"]) == 0
    assert "(5 snapshots of one slot each)" in capsys.readouterr().out
    assert plan_main(args + ["--no-enable-prefix-caching"]) == 0
    assert "snapshots" not in capsys.readouterr().out
    assert plan_main(args + ["--no-enable-prefix-caching", "--num-gdn-snapshots", "5"]) == 2
    assert "drop --no-enable-prefix-caching" in capsys.readouterr().err


def test_engine_takes_the_snapshot_pool_from_the_cache_memory(caplog: pytest.LogCaptureFixture) -> None:
    from deltaserve.cache import sizing
    from deltaserve.cache.sizing import CacheOptions, CacheSizeError, gdn_state_bytes_per_seq, kv_bytes_per_block
    from deltaserve.config import ModelConfig
    from deltaserve.engine.config import EngineConfig
    from tests.checkpoints import TINY

    def plan_cache(cfg, config, kv_dtype):
        return sizing.plan_cache(cfg, kv_dtype, CacheOptions.of(config))

    cfg = ModelConfig.from_dict(dict(TINY, model_type="qwen3_5_text"))
    slot = gdn_state_bytes_per_seq(cfg, torch.float32, torch.float32)
    block = kv_bytes_per_block(cfg, 16, "float32")
    memory = 4 * slot + 3 * slot + 40 * block  # 4 slots, 3 snapshots, 40 blocks
    base = dict(max_num_seqs=4, kv_cache_memory=memory, max_model_len=256)
    plan = plan_cache(cfg, EngineConfig(**base, enable_prefix_caching=True, num_gdn_snapshots=3), torch.float32)
    assert (plan.num_snapshots, plan.num_blocks) == (3, 40)
    assert plan_cache(cfg, EngineConfig(**base, enable_prefix_caching=False), torch.float32).num_snapshots == 0
    assert plan_cache(cfg, EngineConfig(**base), torch.float32).num_snapshots == 16  # on by default
    assert plan_cache(cfg, EngineConfig(**base, enable_prefix_caching=True), torch.float32).num_snapshots == 16
    with pytest.raises(CacheSizeError, match="and 100 prefix-caching snapshots"):
        plan_cache(cfg, EngineConfig(**base, enable_prefix_caching=True, num_gdn_snapshots=100), torch.float32)
    # Left to its default, caching gives way where its pool would not leave room for max_model_len.
    plan = plan_cache(cfg, EngineConfig(**base, num_gdn_snapshots=100), torch.float32)
    assert plan.num_snapshots == 0 and plan.num_blocks == 45 and "prefix caching is off" in caplog.text
    tight = dict(base, max_model_len=20 * 16)  # 45 blocks without snapshots, 16 beside 16 of them
    assert plan_cache(cfg, EngineConfig(**tight), torch.float32).num_snapshots == 0
    with pytest.raises(CacheSizeError, match="needs 20"):
        plan_cache(cfg, EngineConfig(**tight, enable_prefix_caching=True), torch.float32)


def test_cli_flags() -> None:
    import argparse

    from deltaserve.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["enable_prefix_caching"] is None  # the engine's default: on
    kw = engine_kwargs(p.parse_args(["--enable-prefix-caching", "--mamba-cache-mode", "align",
                                     "--mamba-block-size", "128"]))
    assert (kw["enable_prefix_caching"], kw["mamba_cache_mode"], kw["mamba_block_size"]) == (True, "align", 128)
    assert engine_kwargs(p.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False


def test_kv_pool_counts_stay_right_under_random_use() -> None:
    import random

    rng = random.Random(0)
    pool = KVBlockPool(12)
    held: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.35 and pool.num_free:
            blocks = pool.allocate(rng.randint(1, min(3, pool.num_free)))
            for b in blocks:
                if rng.random() < 0.7:
                    pool.cache(b, bytes([rng.randrange(6)]) * 32, rng.choice([None, 1]))
            held.append(blocks)
        elif op < 0.55 and held:
            hit = [c.block_id for c in pool.lookup(bytes([rng.randrange(6)]) * 32)][:1]
            if hit:
                pool.touch(hit)
                held.append(hit)
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        refs = pool.ref_counts
        assert pool.num_shared == sum(1 for r in refs if r > 1), step
        assert pool.num_cached == sum(len(pool.lookup(bytes([k]) * 32)) for k in range(6)), step
        assert pool.num_free == sum(1 for r in refs if r == 0), step


def test_step_hook_skips_a_request_freed_since_it_was_scheduled() -> None:
    from deltaserve.cache.manager import CacheManager

    m = CacheManager(8, 4, 2, SnapshotPool(SnapshotStore(_cache(2), 2)), snapshot_interval=4)
    seq = Seq(list(range(10)), request_id="a")
    assert m.lookup_prefix(seq).num_tokens == 0 and m.allocate("a", 8)
    seq.num_computed_tokens = 8
    m.free("a")  # aborted between schedule and the step's results
    m.after_step([(seq, 0)])
    assert m.blocks.num_cached == 0 and m.prefix.snapshots.num_used == 0


def test_decode_snapshots_replace_each_other_and_the_last_one_stays() -> None:
    """A request past its prompt's snapshot points snapshots each block boundary it decodes to, reusing its
    previous decode snapshot's entry: it holds one at a time, with the state of the newest boundary, and
    leaves the last one behind when it finishes. The prompt's own snapshot is never replaced."""
    from deltaserve.cache.manager import CacheManager

    cache = _cache(2)
    m = CacheManager(16, 4, 2, SnapshotPool(SnapshotStore(cache, 4)), snapshot_interval=64)
    seq = Seq(list(range(100, 106)), request_id="a")  # 6 tokens: the prompt's point is 4
    assert m.lookup_prefix(seq).num_tokens == 0 and m.allocate("a", 6)
    slot = m.state_slots["a"]
    assert m.clip_chunk("a", 0, 6) == 4
    seq.num_computed_tokens = 4
    m.after_step([(seq, 0)])
    seq.num_computed_tokens = 6
    m.after_step([(seq, 4)])
    snaps = m.prefix.snapshots
    assert snaps.num_used == 1  # the prompt point
    for t in range(6, 17):  # decode: tokens 6..16 computed one per step
        seq.tokens.append(200 + t)
        assert m.allocate("a", t + 1)
        cache.ssm[0][slot].fill_(float(t + 1))  # the slot's state "after t+1 tokens"
        seq.num_computed_tokens = t + 1
        m.after_step([(seq, t)])
        assert snaps.num_used == (1 if t + 1 < 8 else 2), t
    hashes = _hashes(seq.tokens, n=4)
    assert hashes[0] in snaps and hashes[3] in snaps and hashes[1] not in snaps and hashes[2] not in snaps
    m.free("a")
    cache.ssm[0].zero_()  # restore into cleared slots: the entry holds the state after 16 tokens
    snaps.restore(hashes[3], 1)
    assert torch.all(cache.ssm[0][1] == 16.0)
    assert snaps.num_used == 2 and not m.prefix._decode_snapshot
