"""Checkpoint -> store: pack every group once and write it into the zarr store on disk.

Runs automatically the first time `run` meets a configured disk tier whose store does not
exist yet, or by hand with `offload convert CHECKPOINT_DIR STORE_DIR`. The manifest carries
the checkpoint's fingerprint, the dtype and the weight format (dense or int8/int4, recorded per
tensor), so a store is never used for another model or another scheme.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import torch
from tqdm import tqdm

from offload.config import DiskTierConfig
from offload.errors import StaleStoreError
from offload.model.checkpoint import Checkpoint
from offload.version import __version__
from offload.weights.groups import DENSE, WeightFormat, group_sources, model_layouts
from offload.weights.reading import check_tensors, fill_group
from storage.layout import dtype_name
from storage.lock import FileLock
from storage.store import Store, StoreState, StoreWriter, open_or_build, store_state
from storage.units import fmt_bytes

log = logging.getLogger(__name__)


def weights_meta(ckpt: Checkpoint, fmt: WeightFormat) -> dict:
    """The format and, per group tensor, its scheme (`dense` or e.g. `int4-g64-asym-rtn`)."""
    cfg = ckpt.config
    moe = [f"layer.{i}" for i, sparse in enumerate(cfg.moe_layers) if sparse][:1]  # and its first expert
    groups = ["layer.0", *moe, *(f"{g}.expert.0" for g in moe), "head"]
    tensors = {t: fmt.scheme(cfg, t) for g in groups for t, _ in group_sources(cfg, g)}
    return fmt.to_json() | {"tensors": tensors}


def store_meta(ckpt: Checkpoint, dtype: torch.dtype, fmt: WeightFormat = DENSE) -> dict:
    return {
        "model_config": ckpt.config.raw,
        "checkpoint": str(ckpt.path),
        "checkpoint_fingerprint": ckpt.fingerprint(),
        "dtype": dtype_name(dtype),
        "weights": weights_meta(ckpt, fmt),
        "offload_version": __version__,
    }


def convert(ckpt: Checkpoint, store_dir: str | Path, dtype: torch.dtype, force: bool = False,
            capacity: int | None = None, progress: bool | None = None, fmt: WeightFormat = DENSE,
            lock: FileLock | None = None) -> Store:
    """Write the store. Interrupted (Ctrl-C, SIGTERM, a kill), what was written stays, journaled, and the
    next conversion of the same checkpoint, dtype and format resumes after it; on any other failure (a
    full disk, a bad tensor) what was written is removed. Re-raises either way.

    Holds the store's lock exclusively while writing: `lock` if the caller holds it, else taken here
    (waiting, with a message, while other processes use the store).
    """
    fmt.check(ckpt.config)
    check_tensors(ckpt, fmt)  # a missing or misshapen tensor is refused before anything is written
    layouts = model_layouts(ckpt.config, dtype, fmt)
    total = sum(layout.nbytes for layout in layouts.values())
    meta = store_meta(ckpt, dtype, fmt)
    writer = StoreWriter(store_dir, total, force=force, capacity=capacity, lock=lock, identity=meta)
    done = [layout for layout in layouts.values() if writer.done(layout)]
    log.info("converting %s into %s (%s, %s, weights %s)%s", ckpt.path, store_dir, fmt_bytes(total, "GiB"),
             dtype_name(dtype), fmt.quantization,
             f": resuming, {len(done)} of {len(layouts)} groups already written" if done else "")
    try:
        buf = torch.empty(max(layout.nbytes for layout in layouts.values()), dtype=torch.uint8)
        # progress None: a bar only when stderr is a terminal
        with tqdm(total=total, initial=sum(layout.nbytes for layout in done), unit="B", unit_scale=True,
                  desc="converting", disable=None if progress is None else not progress) as bar:
            for layout in layouts.values():
                if writer.done(layout):
                    continue
                part = buf[: layout.nbytes]
                fill_group(ckpt, layout, part, fmt)
                writer.write_group(layout, part)
                bar.update(layout.nbytes)
        return writer.finish(meta)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: keep what was written, to resume
        writer.abort(keep=True)
        raise
    except BaseException:
        writer.abort()
        raise


def open_store(ckpt: Checkpoint, store_dir: str | Path, dtype: torch.dtype, capacity: int | None = None,
               page_cache: bool = False, verify: str = "always", auto_convert: bool = True,
               direct_io: bool = False, fmt: WeightFormat = DENSE, progress: bool | None = None) -> Store:
    """The store for this checkpoint, dtype and weight format: converted first if missing or interrupted
    (`progress`: a bar on stderr; None: only when stderr is a terminal), checked if present.

    Safe with several processes on one store: one converts, the others wait for it (see `open_or_build`).
    """
    store_dir = Path(store_dir)

    def build(lock: FileLock) -> None:
        if store_state(store_dir) is StoreState.PARTIAL:
            log.warning("%s holds an interrupted conversion; resuming it (or starting again if it was of "
                        "another checkpoint, dtype or format)", store_dir)
        convert(ckpt, store_dir, dtype, capacity=capacity, fmt=fmt, lock=lock, progress=progress).close()

    again = convert_command(ckpt.path, store_dir, dtype, fmt, ckpt.config.impl)  # what this run reads, as typed
    store = open_or_build(store_dir, build if auto_convert else None, page_cache=page_cache, verify=verify,
                          capacity=capacity, direct_io=direct_io, remedy=again)
    meta = store.meta
    if meta.get("checkpoint_fingerprint") != ckpt.fingerprint():
        store.close()
        raise StaleStoreError(
            f"{store_dir} was converted from a different checkpoint ({meta.get('checkpoint')}); run "
            f"`{again}` or point tiers.disk.path elsewhere"
        )
    if meta.get("dtype") != dtype_name(dtype):
        store.close()
        raise StaleStoreError(
            f"{store_dir} holds {meta.get('dtype')} weights but the run asks for {dtype_name(dtype)}; set dtype: "
            f"{meta.get('dtype')} or convert again with `{again}`"
        )
    have = {k: v for k, v in meta.get("weights", {}).items() if k != "tensors"}
    if not fmt.stored_as(have):
        store.close()
        raise StaleStoreError(
            f"{store_dir} holds weights stored as {have} but the run asks for {fmt.to_json()}; set `weights:` to "
            f"match, or convert again with `{again}`"
        )
    expected = model_layouts(ckpt.config, dtype, fmt)
    if {n: g.layout for n, g in store.groups.items()} != expected:
        store.close()
        raise StaleStoreError(f"{store_dir}: its group layouts differ from this run's (another Offload version, or "
                         f"model_impl {ckpt.config.impl} where it was converted for the other); convert again with "
                         f"`{again}`")
    if meta.get("weights", {}).get("tensors", {}) != weights_meta(ckpt, fmt)["tensors"]:
        store.close()
        raise StaleStoreError(f"{store_dir} stores its weights in another scheme or byte order than this Offload "
                              f"reads (an earlier version's); convert again with `{again}`")
    return store


def open_tier_store(ckpt: Checkpoint, disk: DiskTierConfig, dtype: torch.dtype, fmt: WeightFormat = DENSE,
                    progress: bool | None = None) -> Store:
    """`open_store` for a config's `tiers.disk`: its path, capacity, page cache, verification and direct I/O (off
    where the page cache is asked for)."""
    return open_store(ckpt, disk.path, dtype, capacity=disk.capacity, page_cache=disk.page_cache, verify=disk.verify,
                      direct_io=disk.direct_io and not disk.page_cache, fmt=fmt, progress=progress)


def convert_command(checkpoint: Path, store_dir: Path, dtype: torch.dtype, fmt: WeightFormat,
                    impl: str = "native") -> str:
    """The `offload convert` command that writes the store a run of this dtype, weight format and model_impl reads."""
    cmd = f"offload convert {shlex.quote(str(checkpoint))} {shlex.quote(str(store_dir))} --dtype {dtype_name(dtype)}"
    if fmt.prequant is None and fmt.quantization == "none":
        cmd += " --weights none"
    elif fmt.prequant is None:  # a GPTQ/AWQ checkpoint's format is its own
        cmd += f" --weights {fmt.quantization} --group-size {fmt.group_size} --keep" + "".join(
            f" {k}" for k in sorted(fmt.keep))
    return cmd + f" --model-impl {impl} --force"
