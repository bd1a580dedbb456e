"""One conformance suite that every tier passes (zarr-python's StoreTests pattern).

Each subclass says how to make its tier; the behaviour is the same: fixed regions allocated
once, refused with what would fit, bytes round-trip exactly, partial reads, a read-only guard.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from storage import io as sio
from storage.arena import aligned_empty
from storage.disk import DiskTier
from storage.errors import CapacityError, StoreError
from storage.tiers import DeviceTier, HostTier, Tier


def payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class TierTests:
    """Subclasses provide `make(capacity) -> Tier`."""

    def make(self, tmp_path, capacity: int | None) -> Tier:
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path):
        t = self.make(tmp_path, 1 << 20)
        yield t
        t.close()

    def test_bytes_round_trip_exactly(self, tier):
        data = payload(300_000)
        tier.allocate("a", data.numel())
        tier.write("a", data)
        out = torch.empty_like(data)
        tier.read_into("a", out)
        assert torch.equal(out, data)

    def test_partial_read_at_an_offset(self, tier):
        data = payload(10_000, seed=1)
        tier.allocate("a", data.numel())
        tier.write("a", data)
        out = torch.empty(1000, dtype=torch.uint8)
        tier.read_into("a", out, offset=4321)
        assert torch.equal(out, data[4321:5321])

    def test_typed_destination_gets_the_same_bits(self, tier):
        vals = torch.randn(256, dtype=torch.float32).to(torch.bfloat16)
        raw = vals.view(torch.uint8)
        tier.allocate("bf16", raw.numel())
        tier.write("bf16", raw)
        out = torch.empty(256, dtype=torch.bfloat16)
        tier.read_into("bf16", out)
        assert torch.equal(out.view(torch.int16), vals.view(torch.int16))  # bit-exact

    def test_capacity_is_enforced_with_what_would_fit(self, tier):
        tier.allocate("a", 700_000)
        assert tier.used == 700_000 and tier.free == (1 << 20) - 700_000
        with pytest.raises(CapacityError, match=rf"the {tier.kind} tier cannot hold 'b'.*raise tiers\.{tier.kind}"
                                                r"\.capacity to at least 1\.3 MiB"):
            tier.allocate("b", 700_000)
        assert "b" not in tier and tier.used == 700_000

    def test_release_gives_capacity_back(self, tier):
        tier.allocate("a", 800_000)
        tier.release("a")
        assert tier.used == 0
        tier.allocate("b", 800_000)
        assert tier.keys() == ["b"]

    def test_a_key_is_allocated_once(self, tier):
        tier.allocate("a", 10)
        with pytest.raises(KeyError, match="already holds 'a'"):
            tier.allocate("a", 10)

    def test_reads_outside_a_region_are_refused(self, tier):
        tier.allocate("a", 100)
        tier.write("a", payload(100))
        with pytest.raises(ValueError, match="outside its 100 bytes"):
            tier.read_into("a", torch.empty(50, dtype=torch.uint8), offset=60)
        with pytest.raises(KeyError):
            tier.read_into("nope", torch.empty(1, dtype=torch.uint8))

    def test_read_only_guard_refuses_writes(self, tier):
        tier.allocate("a", 64)
        tier.read_only = True
        with pytest.raises(StoreError, match="read-only"):
            tier.write("a", payload(64))
        with pytest.raises(StoreError, match="read-only"):
            tier.allocate("b", 64)

    def test_unlimited_capacity(self, tmp_path):
        t = self.make(tmp_path / "unlimited", None)
        try:
            t.allocate("big", 3 << 20)
            assert t.free is None
        finally:
            t.close()


class TestDeviceTier(TierTests):
    def make(self, tmp_path, capacity):
        return DeviceTier(capacity, "cpu")

    def test_views_are_the_region_itself(self, tier):
        tier.allocate("a", 16)
        tier.view("a").fill_(7)
        out = torch.empty(16, dtype=torch.uint8)
        tier.read_into("a", out)
        assert out.tolist() == [7] * 16


class TestHostTier(TierTests):
    def make(self, tmp_path, capacity):
        return HostTier(capacity)


class TestDiskTier(TierTests):
    def make(self, tmp_path, capacity):
        return DiskTier(tmp_path / "store", capacity)

    def test_regions_are_zarr_arrays_that_zarr_itself_reads(self, tier):
        data = payload(50_000, seed=3)
        tier.allocate("layer.0", data.numel())
        tier.write("layer.0", data)
        assert np.array_equal(tier.read_with_zarr("layer.0"), data.numpy())  # zarr decodes + checks crc32c

    def test_a_flipped_byte_is_caught_on_read(self, tier):
        data = payload(20_000, seed=4)
        tier.allocate("a", data.numel())
        tier.write("a", data)
        path = tier._chunks["a"].path
        raw = bytearray(path.read_bytes())
        raw[1234] ^= 0x01
        path.write_bytes(bytes(raw))
        with pytest.raises(StoreError, match="checksum mismatch.*convert it again"):
            tier.read_into("a", torch.empty_like(data))

    def test_partial_reads_verify_the_region_first(self, tier):
        data = payload(20_000, seed=5)
        tier.allocate("a", data.numel())
        tier.write("a", data)
        reopened = DiskTier(tier.path, read_only=True)
        try:
            reopened.open_existing("a", data.numel())
            path = reopened._chunks["a"].path
            raw = bytearray(path.read_bytes())
            raw[19_000] ^= 0x01  # far from the bytes we read
            path.write_bytes(bytes(raw))
            with pytest.raises(StoreError, match="checksum mismatch"):
                reopened.read_into("a", torch.empty(10, dtype=torch.uint8), offset=5)
        finally:
            reopened.close()

    def test_truncated_chunk_is_refused_on_open(self, tier):
        tier.allocate("a", 5000)
        tier.write("a", payload(5000))
        path = tier._chunks["a"].path
        with open(path, "r+b") as f:
            f.truncate(4000)
        ro = DiskTier(tier.path, read_only=True)
        try:
            with pytest.raises(StoreError, match=r"chunk is 4000 bytes, expected 5004.*truncated"):
                ro.open_existing("a", 5000)
        finally:
            ro.close()

    def test_large_reads_split_across_threads_are_exact(self, tmp_path):
        t = DiskTier(tmp_path / "big", read_threads=3)
        try:
            data = payload(20 * 2**20 + 123, seed=6)
            t.allocate("a", data.numel())
            t.write("a", data)
            out = torch.empty_like(data)
            t.read_into("a", out)
            assert torch.equal(out, data)
        finally:
            t.close()

    def test_full_disk_is_one_clear_error_and_leaves_no_partial_file(self, tier, monkeypatch):
        import errno

        tier.allocate("a", 4096)

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(StoreError, match="the disk is full"):
            tier.write("a", payload(4096))
        assert not list(tier.path.rglob("*.partial"))


def test_direct_reads_land_in_aligned_slots_without_touching_the_page_cache(tmp_path, monkeypatch):
    """O_DIRECT: page-aligned destinations are read by the disk itself (nothing to drop from the page cache);
    an unaligned destination (a row of the embeddings) still reads through the page cache."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (3 * 4096 * 5,), dtype=torch.uint8, generator=g)
    writer = DiskTier(tmp_path / "d")
    writer.allocate("a", data.numel())
    writer.write("a", data)
    writer.close()
    tier = DiskTier(tmp_path / "d", read_only=True, direct_io=True, verify="always")
    tier.open_existing("a", data.numel())
    drops = []
    monkeypatch.setattr(sio, "drop_page_cache", lambda *a: drops.append(a))
    try:
        whole = aligned_empty(data.numel())
        tier.read_into("a", whole)  # checksummed: a corrupt or short O_DIRECT read would raise here
        assert torch.equal(whole, data)
        if not tier.reader.direct(tier.chunk_path("a")):
            pytest.skip("this file system refuses O_DIRECT")
        assert drops == []
        piece = aligned_empty(4096 * 5)
        tier.read_into("a", piece, offset=4096 * 5)
        assert torch.equal(piece, data[4096 * 5 : 4096 * 10]) and drops == []
        row = torch.empty(100, dtype=torch.uint8)
        tier.read_into("a", row, offset=123)
        assert torch.equal(row, data[123:223]) and len(drops) == 1
    finally:
        tier.close()
