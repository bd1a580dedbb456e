"""Conversion into the zarr store, and every way a store can be bad: each one clear error, never wrong tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import storage.store as st
from offload.errors import CapacityError, StoreError
from offload.model.checkpoint import Checkpoint
from offload.runtime.runner import Runner
from offload.weights.convert import convert
from offload.weights.groups import model_layouts
from storage.store import MARKER, Store, StoreState, store_state
from tests.conftest import run_config

PROMPT = [1, 40, 41, 300, 7, 99, 12]


def disk_config(model: Path, store: Path, **kw) -> dict:
    """Everything streamed from disk: tiny gpu and cpu budgets."""
    return run_config(model, tiers={"gpu": {"capacity": "3MiB"}, "cpu": {"capacity": "1MiB"},
                                    "disk": {"path": str(store)}},
                      kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 16}, **kw)


def tokens(cfg: dict, n: int = 12) -> list[int]:
    with Runner.from_config(cfg) as r:
        return r.generate([PROMPT], max_new_tokens=n, stop_on_eos=False)[0].token_ids


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return tokens(run_config(tiny_llama))


def test_bfloat16_is_kept_bit_exact(tmp_path, model_factory):
    path = model_factory("llama", dtype="bfloat16")
    ckpt = Checkpoint(path)
    store = convert(ckpt, tmp_path / "s", torch.bfloat16, progress=False)
    try:
        layout = store.groups["layer.1"].layout
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        store.tier.read_into("layer.1", buf)
        qkv = layout.views(buf)["qkv"]
        ref = {}
        for f in path.glob("*.safetensors"):
            ref.update(load_file(f))
        q = ref["model.layers.1.self_attn.q_proj.weight"]
        assert torch.equal(qkv[: q.shape[0]].view(torch.int16), q.view(torch.int16))
        meta = json.loads((tmp_path / "s" / "manifest.json").read_text())
        assert meta["groups"]["layer.1"]["tensors"][1]["dtype"] == "bfloat16"
        assert meta["meta"]["dtype"] == "bfloat16" and meta["version"] == 2
        # the zarr array holds raw uint8 bytes; zarr itself reads them back identically
        assert np.array_equal(store.tier.read_with_zarr("layer.1"), buf.numpy())
    finally:
        store.close()


def test_run_converts_on_first_use_and_reuses_the_store(tmp_path, tiny_llama, reference):
    store = tmp_path / "store"
    assert tokens(disk_config(tiny_llama, store)) == reference
    assert store_state(store) is StoreState.COMPLETE
    stamp = (store / "manifest.json").stat().st_mtime_ns
    assert tokens(disk_config(tiny_llama, store)) == reference
    assert (store / "manifest.json").stat().st_mtime_ns == stamp  # not converted twice


def test_interrupted_conversion_is_detected_and_restarted_cleanly(tmp_path, tiny_llama, reference):
    store = tmp_path / "store"
    code = (
        "import os, torch\n"
        "from offload.model.checkpoint import Checkpoint\n"
        "import storage.store as st\n"
        "orig = st.StoreWriter.write_group\n"
        "n = [0]\n"
        "def dying(self, layout, data):\n"
        "    orig(self, layout, data)\n"
        "    n[0] += 1\n"
        "    if n[0] == 3: os._exit(9)  # like a SIGKILL half way\n"
        "st.StoreWriter.write_group = dying\n"
        "from offload.weights.convert import convert\n"
        f"convert(Checkpoint(r'{tiny_llama}'), r'{store}', torch.float32, progress=False)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == 9
    assert store_state(store) is StoreState.PARTIAL and (store / MARKER).exists()
    with pytest.raises(StoreError, match="conversion into this store was interrupted"):
        Store.open(store)
    assert tokens(disk_config(tiny_llama, store)) == reference  # run restarts the conversion
    assert store_state(store) is StoreState.COMPLETE and not (store / MARKER).exists()


def test_an_interrupted_conversion_resumes_after_its_last_whole_group(tmp_path, tiny_llama, reference, monkeypatch):
    """Ctrl-C (or a kill) half way through converting a 140 GB model must not cost the half already written:
    the next conversion of the same checkpoint, dtype and format writes only the groups still missing, and
    rewrites a journaled group whose bytes were damaged since; another dtype starts again from scratch."""
    ckpt, store = Checkpoint(tiny_llama), tmp_path / "store"
    groups = list(model_layouts(ckpt.config, torch.float32))
    written: list[str] = []
    real = st.StoreWriter.write_group

    def counting(self, layout, data, stop_after=None):
        real(self, layout, data)
        written.append(layout.name)
        if stop_after is not None and len(written) == stop_after:
            raise KeyboardInterrupt

    monkeypatch.setattr(st.StoreWriter, "write_group", lambda self, lo, d: counting(self, lo, d, stop_after=3))
    with pytest.raises(KeyboardInterrupt):
        convert(ckpt, store, torch.float32, progress=False)
    assert store_state(store) is StoreState.PARTIAL and written == groups[:3]  # kept, journaled
    first = {g: chunk_of(store, g).stat().st_mtime_ns for g in groups[:3]}
    with open(chunk_of(store, groups[1]), "r+b") as f:  # damaged since: cut short
        f.truncate(16)
    written.clear()
    monkeypatch.setattr(st.StoreWriter, "write_group", lambda self, lo, d: counting(self, lo, d))
    convert(ckpt, store, torch.float32, progress=False).close()
    assert written == [groups[1], *groups[3:]]  # only what was missing or damaged
    assert chunk_of(store, groups[0]).stat().st_mtime_ns == first[groups[0]]
    assert store_state(store) is StoreState.COMPLETE and tokens(disk_config(tiny_llama, store)) == reference

    other = tmp_path / "other"
    monkeypatch.setattr(st.StoreWriter, "write_group", lambda self, lo, d: counting(self, lo, d, stop_after=2))
    written.clear()
    with pytest.raises(KeyboardInterrupt):
        convert(ckpt, other, torch.float32, progress=False)
    written.clear()
    monkeypatch.setattr(st.StoreWriter, "write_group", lambda self, lo, d: counting(self, lo, d))
    convert(ckpt, other, torch.bfloat16, progress=False).close()  # another dtype: nothing of the first is kept
    assert written == groups


def test_complete_store_is_not_overwritten_without_force(tmp_path, tiny_llama):
    ckpt = Checkpoint(tiny_llama)
    convert(ckpt, tmp_path / "s", torch.float32, progress=False).close()
    with pytest.raises(StoreError, match="already holds a converted store; pass --force"):
        convert(ckpt, tmp_path / "s", torch.float32, progress=False)
    convert(ckpt, tmp_path / "s", torch.float32, force=True, progress=False).close()


def test_a_foreign_directory_is_never_deleted(tmp_path, tiny_llama):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "holiday.jpg").write_bytes(b"precious")
    for force in (False, True):
        with pytest.raises(StoreError, match="is not an Offload store; choose an empty or new directory"):
            convert(Checkpoint(tiny_llama), mine, torch.float32, force=force, progress=False)
    assert (mine / "holiday.jpg").read_bytes() == b"precious"


def test_not_enough_free_space_is_refused_before_writing(tmp_path, tiny_llama, monkeypatch):
    import shutil as sh
    real = sh.disk_usage
    monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=1024))
    with pytest.raises(StoreError, match=r"converting needs .* GiB free but the disk has 0\.00 GiB"):
        convert(Checkpoint(tiny_llama), tmp_path / "s", torch.float32, progress=False)
    assert not (tmp_path / "s").exists()


def test_disk_capacity_too_small_for_the_store(tmp_path, tiny_llama):
    cfg = disk_config(tiny_llama, tmp_path / "s")
    cfg["tiers"]["disk"]["capacity"] = "1MiB"
    with pytest.raises(CapacityError, match=r"tiers\.disk\.capacity is 1\.0 MiB; raise it to at least"):
        Runner.from_config(cfg)


def test_disk_full_during_conversion_cleans_up(tmp_path, tiny_llama, monkeypatch):
    import errno
    import os

    real = os.pwrite
    calls = [0]

    def flaky(fd, data, offset):
        calls[0] += 1
        if calls[0] > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", flaky)
    with pytest.raises(StoreError, match="the disk is full"):
        convert(Checkpoint(tiny_llama), tmp_path / "s", torch.float32, progress=False)
    assert store_state(tmp_path / "s") is StoreState.MISSING  # nothing half-written is left behind


# ----------------------------------------------------------------------------- damaged stores at run time
@pytest.fixture
def good_store(tmp_path, tiny_llama):
    store = tmp_path / "store"
    convert(Checkpoint(tiny_llama), store, torch.float32, progress=False).close()
    return store


def chunk_of(store: Path, group: str) -> Path:
    return store / group / "c.0"


@pytest.mark.parametrize("damage,match", [
    ("truncate", r"chunk is \d+ bytes, expected \d+; the store is damaged or truncated"),
    ("delete_chunk", r"chunk is missing"),
    ("no_manifest", r"not an Offload store \(no manifest.json\)"),
    ("garbage_manifest", r"unreadable or not an Offload manifest"),
    ("old_version", r"store format version 0 is not 2"),
    ("version_1", r"format version 1, from before quantized weights .* --force"),
    ("swap_chunks", r"does not match the manifest \(checksum differs\)"),
])
def test_damaged_store_is_one_clear_error(tmp_path, tiny_llama, good_store, damage, match):
    layer = chunk_of(good_store, "layer.2")
    if damage == "truncate":
        with open(layer, "r+b") as f:
            f.truncate(layer.stat().st_size - 100)
    elif damage == "delete_chunk":
        layer.unlink()
    elif damage == "no_manifest":
        (good_store / "manifest.json").unlink()
    elif damage == "garbage_manifest":
        (good_store / "manifest.json").write_text("{not json")
    elif damage in ("old_version", "version_1"):
        m = json.loads((good_store / "manifest.json").read_text())
        m["version"] = 0 if damage == "old_version" else 1
        (good_store / "manifest.json").write_text(json.dumps(m))
    elif damage == "swap_chunks":
        shutil.copy(chunk_of(good_store, "layer.1"), layer)
    with pytest.raises(StoreError, match=match) as info:
        Runner.from_config(disk_config(tiny_llama, good_store))
    assert "\n" not in str(info.value)
    if damage != "no_manifest":  # a damaged store names the exact command that rebuilds it for this run
        assert f"`offload convert {tiny_llama} {good_store} --dtype float32 " in str(info.value)
        assert str(info.value).endswith("--force`")


def test_flipped_byte_in_a_streamed_layer_is_an_error_not_wrong_tokens(tiny_llama, good_store):
    layer = chunk_of(good_store, "layer.2")
    raw = bytearray(layer.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    layer.write_bytes(bytes(raw))
    # the crc trailer still matches the manifest, so open succeeds; the read is what catches it
    with pytest.raises(StoreError, match=f"checksum mismatch.*; convert it again: `offload convert {tiny_llama} "):
        with Runner.from_config(disk_config(tiny_llama, good_store)) as r:
            r.generate([PROMPT], max_new_tokens=4)


def test_flipped_byte_in_a_memory_homed_group_is_caught_at_load(tiny_llama, good_store):
    cfg = disk_config(tiny_llama, good_store)
    cfg["tiers"]["gpu"]["capacity"] = "64MiB"  # everything homed on the device, loaded from the store
    raw = bytearray(chunk_of(good_store, "head").read_bytes())
    raw[10] ^= 0x01
    chunk_of(good_store, "head").write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="checksum mismatch"):
        Runner.from_config(cfg)


def test_store_from_another_checkpoint_is_refused(tmp_path, model_factory, good_store):
    other = model_factory("llama", seed=1)  # same shapes, other weights
    with pytest.raises(StoreError, match=r"was converted from a different checkpoint .*--force"):
        Runner.from_config(disk_config(other, good_store))


def test_store_of_another_dtype_is_refused(tiny_llama, good_store):
    with pytest.raises(StoreError, match=r"holds float32 weights but the run asks for bfloat16"):
        Runner.from_config(disk_config(tiny_llama, good_store) | {"dtype": "bfloat16"})


def test_store_whose_manifest_records_other_schemes_is_refused_with_the_command_that_converts_it(tmp_path,
                                                                                                 model_factory):
    """Packed bytes of another scheme or byte order (an earlier Offload's) can have the same shapes as this one's: the
    manifest's per-tensor schemes tell them apart, so they are never multiplied as they are."""
    model = model_factory("llama", overrides={"intermediate_size": 384})
    store = tmp_path / "store"
    cfg = disk_config(model, store, weights={"quantization": "int4", "group_size": 64})
    tokens(cfg, 2)  # converted by the first run
    manifest = json.loads((store / "manifest.json").read_text())
    schemes = manifest["meta"]["weights"]["tensors"]
    assert schemes["qkv"] == "int4-g64-asym-rtn" and schemes["input_norm"] == "dense"
    manifest["meta"]["weights"]["tensors"] = schemes | {"qkv": "int4-g64-asym-rtn-v0"}
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"another scheme or byte order than this Offload reads .*--weights int4 "
                                         r"--group-size 64 .*--force"):
        Runner.from_config(cfg)


def test_store_layouts_follow_the_checkpoint(tiny_llama, good_store):
    store = Store.open(good_store)
    try:
        assert {n: g.layout for n, g in store.groups.items()} == model_layouts(Checkpoint(tiny_llama).config,
                                                                                 torch.float32)
    finally:
        store.close()
