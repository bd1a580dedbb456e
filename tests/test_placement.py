"""Placement plans as values: homes, ring sizing, spreading, and refusals that say what would fit."""

from __future__ import annotations

import pytest

from offload.plan.placement import MIN_STAGE, STAGE_PIECE, GroupSpec, make_plan
from schedulers.plan import Capacities
from storage.arena import PAGE
from storage.errors import CapacityError

MiB = 2**20
LAYER, HEAD, EMBED = 88 * MiB, 131 * MiB, 131 * MiB


def model(layers: int = 22) -> list[GroupSpec]:
    return ([GroupSpec("embed", EMBED, rows_only=True)] + [GroupSpec(f"layer.{i}", LAYER) for i in range(layers)]
            + [GroupSpec("head", HEAD)])


def test_everything_fits_so_nothing_streams():
    plan = make_plan(model(4), Capacities(4096 * MiB, None, None), depth=2, kv_bytes=10 * MiB)
    assert set(plan.homes.values()) == {"gpu"} and plan.streamed == [] and plan.ring_slots == 0
    assert plan.bytes_per_step() == {}


def test_a_large_head_is_homed_rather_than_sizing_every_ring_slot_for_it():
    caps = Capacities(512 * MiB, 512 * MiB, None, has_disk=True)
    plan = make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, workspace_bytes=10 * MiB, copy_to_device=False)
    assert plan.homes["head"] == "gpu"
    assert plan.ring_slot_bytes == LAYER and plan.ring_slots == 3
    assert plan.used("gpu") + plan.used("cpu") <= caps.gpu + caps.cpu
    assert plan.homes["embed"] == "disk"  # read by rows: the slowest tier is fine
    # the device's unused 87 MiB is lent to the host (a CPU device: the same RAM): 6 x 88 MiB in 512 + 87 MiB
    assert plan.lent == 512 * MiB - 30 * MiB - 3 * LAYER - HEAD
    assert [plan.homes[f"layer.{i}"] for i in range(22)].count("cpu") == 6
    assert plan.used("cpu") <= plan.capacity("cpu") and plan.used("gpu") <= plan.capacity("gpu")


def test_homed_layers_are_spread_over_the_pass():
    caps = Capacities(512 * MiB, 512 * MiB, None, has_disk=True)
    plan = make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, workspace_bytes=10 * MiB)
    cpu = [i for i in range(22) if plan.homes[f"layer.{i}"] == "cpu"]
    gaps = [b - a for a, b in zip(cpu, cpu[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spaced, not a block of consecutive layers


def test_copy_routes_reserve_staging_on_the_host():
    caps = Capacities(512 * MiB, 512 * MiB, None, has_disk=True)
    cuda = make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, copy_to_device=True)
    cpu = make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, copy_to_device=False)
    assert cuda.stage_slots == 2 and cuda.stage_slot_bytes == STAGE_PIECE < LAYER and cpu.stage_slots == 0
    assert cuda.lent == 0  # on CUDA the device and the host are different memories
    assert cuda.route("layer.0") in (("disk", "cpu", "gpu"), ("cpu", "gpu"), ("gpu",))
    assert all(cpu.route(g) != ("cpu", "gpu") for g in cpu.order)  # host memory is device memory on a CPU
    assert "disk->cpu" in cuda.bytes_per_step() and "disk->gpu" in cpu.bytes_per_step()
    assert sum(1 for g in cuda.order if cuda.homes[g] == "cpu") < sum(1 for g in cpu.order if cpu.homes[g] == "cpu")


def test_bytes_per_step_count_each_link():
    caps = Capacities(512 * MiB, 512 * MiB, None, has_disk=True)
    plan = make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, copy_to_device=True)
    disk = sum(plan.sizes[g] for g in plan.streamed if plan.homes[g] == "disk")
    host = sum(plan.sizes[g] for g in plan.streamed if plan.homes[g] == "cpu")
    assert plan.bytes_per_step() == {"disk->cpu": disk, "cpu->gpu": disk + host}


def test_ring_that_cannot_fit_names_the_minimum_gpu_capacity():
    with pytest.raises(CapacityError, match=r"raise tiers\.gpu\.capacity to at least 423\.0 MiB or lower "
                                            r"prefetch\.depth to 0$"):  # 30 MiB + a 131 MiB slot fits 200 MiB
        make_plan(model(), Capacities(200 * MiB, None, None, True), depth=2, kv_bytes=30 * MiB)


def test_no_disk_tier_names_the_cpu_capacity_that_would_fit():
    with pytest.raises(CapacityError, match=r"there is no disk tier; add tiers\.disk .* raise tiers\.cpu\.capacity "
                                            r"to at least"):
        make_plan(model(), Capacities(512 * MiB, 512 * MiB, None, False), depth=1)


def test_disk_capacity_below_the_store_is_refused():
    with pytest.raises(CapacityError, match=r"the store needs .* but tiers\.disk\.capacity is"):
        make_plan(model(), Capacities(512 * MiB, 512 * MiB, 1024 * MiB, True), depth=1)


def test_describe_lists_every_tier_and_what_moves():
    plan = make_plan(model(), Capacities(512 * MiB, 512 * MiB, None, True), depth=2, kv_bytes=20 * MiB,
                     copy_to_device=False)
    text = plan.describe()
    for piece in ("gpu", "cpu", "disk", "ring slots", "per forward pass: disk->gpu", "layer."):
        assert piece in text


@pytest.mark.parametrize("cpu", [0, MIN_STAGE])
def test_gpu_and_disk_with_no_room_for_staging_is_refused_naming_the_cpu_capacity(cpu):
    """CUDA, disk-homed layers, and a cpu tier that cannot hold the two pinned staging buffers."""
    caps = Capacities(512 * MiB, cpu, None, has_disk=True)
    with pytest.raises(CapacityError, match=r"pinned staging buffers .* raise tiers\.cpu\.capacity to at least "
                                            r"2\.0 MiB \(128\.0 MiB for full-speed pieces\)"):
        make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, copy_to_device=True)
    # on a CPU device the disk reads land in the ring: no staging, nothing to refuse
    assert make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, copy_to_device=False).stage_slots == 0


@pytest.mark.parametrize("cpu", [4 * MiB, LAYER + 4096, 200 * MiB])
def test_staging_shrinks_to_what_the_cpu_tier_holds_and_is_counted_in_it(cpu):
    caps = Capacities(512 * MiB, cpu, None, has_disk=True)
    plan = make_plan(model(), caps, depth=2, kv_bytes=20 * MiB, copy_to_device=True)
    assert plan.stage_slots == 2 and MIN_STAGE <= plan.stage_slot_bytes <= STAGE_PIECE
    assert plan.stage_slot_bytes % 4096 == 0
    assert plan.used("cpu") <= cpu  # the staging buffers fit the budget the user gave
    regions = 2 + sum(1 for g in plan.order if plan.homes[g] == "cpu")
    assert plan.used("cpu") <= plan.pinned_bytes() <= plan.used("cpu") + regions * PAGE  # whole pages per region
    assert "pinned host memory" in plan.describe() and plan.to_dict()["pinned_bytes"] == plan.pinned_bytes()
