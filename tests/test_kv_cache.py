"""The block pool and the paged KV cache: ownership, admission, slots, masks."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from offload.kv.blocks import slot_table, tier_blocks
from offload.kv.cache import PagedKVCache
from offload.model.config import ModelConfig
from offload.model.layout import BatchLayout
from storage.block_pool import Admission, BlockPool
from storage.errors import CapacityError

CFG = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "num_hidden_layers": 2, "intermediate_size": 32,
                             "vocab_size": 50})


def test_pool_hands_out_each_block_once_and_takes_it_back():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    assert pool.can_allocate(1) is Admission.OK
    assert pool.can_allocate(2) is Admission.LATER
    assert pool.can_allocate(5) is Admission.NEVER
    with pytest.raises(CapacityError, match="asked for 2 blocks but the pool has 1 free of 4"):
        pool.allocate(2)
    assert pool.free(a[:2]) == a[:2]  # the blocks that came back
    assert pool.num_free == 3
    # FIFO: the block that was free all along comes out before the ones just freed
    [b] = pool.allocate(1)
    assert b not in a


def test_shared_block_returns_only_when_every_reference_is_dropped():
    pool = BlockPool(2)
    [blk] = pool.allocate(1)
    pool.incref([blk])
    assert pool.refcount(blk) == 2
    pool.free([blk])
    assert pool.num_free == 1 and pool.refcount(blk) == 1
    pool.free([blk])
    assert pool.num_free == 2
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([blk])


def test_tokens_land_in_their_block_and_offset_and_read_back_in_order():
    kv = PagedKVCache(CFG, block_size=4, num_blocks=8, dtype=torch.float32, device="cpu")
    a, b = kv.add_sequence(), kv.add_sequence()
    # step 1: a gets 6 tokens, b gets 3
    layout, step = kv.prepare([a, b], [6, 3])
    k = torch.arange(9, dtype=torch.float32)[:, None, None].expand(9, 1, 8).clone()
    view = kv.view(1, layout, step)
    view.write(k, -k)
    data = kv.stores["gpu"].arrays["kv"].data  # [layers, slots, 2, block_size, kv_heads, head_dim]
    # block table of a: 2 blocks; token 5 -> block 1, offset 1
    blocks_a = [kv.blocks[bid].slot for bid in kv.seqs[a].blocks]
    blocks_b = [kv.blocks[bid].slot for bid in kv.seqs[b].blocks]
    assert len(blocks_a) == 2 and len(blocks_b) == 1
    assert data[1, blocks_a[1], 0, 1, 0, 0] == 5
    assert data[1, blocks_b[0], 1, 2, 0, 0] == -8
    [group] = step.groups
    assert group.tier == "gpu" and group.cols == 2
    assert group.positions[0].tolist() == list(range(8))
    assert group.valid[0].tolist() == [True] * 6 + [False] * 2
    assert group.valid[1].tolist() == [True] * 3 + [False] * 5
    mask = layout.mask(group.positions, group.valid, None)
    # causal: query 2 of a (position 2) sees keys 0..2 only; padding keys of b are never visible
    assert mask[0, 2].tolist() == [True] * 3 + [False] * 5
    assert mask[1, 2].tolist() == [True] * 3 + [False] * 5
    assert not mask[1, 3:].any()  # padded query rows of b see nothing
    kv.free_sequence(a)
    assert kv.pool.num_free == 8 - 1


def test_decode_step_positions_and_sliding_window_mask():
    kv = PagedKVCache(CFG, block_size=4, num_blocks=8, dtype=torch.float32, device="cpu")
    s = kv.add_sequence()
    kv.prepare([s], [9])
    layout, step = kv.prepare([s], [1])
    assert layout.positions.tolist() == [9] and layout.kv_lens == [10]
    [group] = step.groups
    mask = layout.mask(group.positions, group.valid, window=3)
    # position 9 with a window of 3 sees positions 7, 8, 9 (q - k < window)
    assert mask[0, 0].nonzero().flatten().tolist() == [7, 8, 9]


def test_batch_layout_pads_and_unpads():
    layout = BatchLayout.build([2, 1, 3], [5, 1, 3], "cpu")
    assert layout.positions.tolist() == [3, 4, 0, 0, 1, 2]
    assert layout.pad_index.tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5]]
    assert layout.unpad_index.tolist() == [0, 1, 3, 6, 7, 8]
    assert layout.last_token_rows().tolist() == [1, 2, 5]


def test_a_step_in_one_tier_gets_the_same_index_tensors_as_the_general_path():
    """The one-tier fast path (`blocks.one_tier`, numpy) against `tier_blocks` (tensor ops over the cache's
    (tier, slot) table), and each new token's slot against its block table, on a batch of uneven sequences whose
    blocks were taken out of order."""
    kv = PagedKVCache(CFG, block_size=4, num_blocks=16, dtype=torch.float32, device="cpu")
    a, b, c = kv.add_sequence(), kv.add_sequence(), kv.add_sequence()
    kv.prepare([a, b, c], [6, 1, 9])
    kv.prepare([b], [7])  # b's second block comes after c's
    layout, step = kv.prepare([a, b, c], [1, 3, 2])
    assert layout.kv_lens == [7, 11, 11] and layout.positions.tolist() == [6, 8, 9, 10, 9, 10]
    [fast] = step.groups
    general = tier_blocks(kv._where, "gpu", step.block_ids, layout.kv_lens, (step.positions, step.valid), 4,
                          torch.device("cpu"))
    assert general is not None and fast.tier == general.tier and fast.cols == general.cols == 3
    assert fast.slots == general.slots and fast.ids == general.ids
    for name in ("seq", "block", "col", "positions", "valid", "slot_index"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert torch.equal(step.table, slot_table((general,), step.block_ids))
    for sid, rows in ((a, [0]), (b, [1, 2, 3]), (c, [4, 5])):
        blocks = kv.seqs[sid].blocks
        for row, pos in zip(rows, layout.positions[rows].tolist()):
            assert step.slot_blocks[row] == kv.blocks[blocks[pos // 4]].slot and step.slot_offsets[row] == pos % 4


def test_a_pool_let_go_is_freed_at_once_not_when_the_collector_comes_round():
    """A pool and its prefix cache referred to each other, so a pool closed and dropped (`Executor.ensure_kv` making a
    larger one "after the old one goes", a calibration's probes) kept its memory until the cyclic collector ran: a
    calibration left 842 MiB held. The index refers back weakly; the pool, with a prefix cache on, dies on its last
    reference with the collector off, and the index still reaches it while it lives."""
    gc.disable()
    try:
        kv = PagedKVCache(CFG, block_size=4, num_blocks=8, dtype=torch.float32, device="cpu")
        assert kv.prefix is not None  # (on by default)
        sid = kv.add_sequence()
        kv.prepare([sid], [6])
        assert kv.prefix.kv.pool is kv.pool
        kv.close()
        gone = weakref.ref(kv)
        del kv
        assert gone() is None
    finally:
        gc.enable()
