"""RAM `auto` inside a memory cgroup: the planner reads the process's cgroup limit (a container, a job's limit),
not only the machine's free memory, or a run planned for 20 GiB would be killed by a 2 GiB limit."""

from pathlib import Path

import torch

from offload.config import CpuTierConfig, GpuTierConfig, OffloadConfig, TiersConfig
from offload.model.checkpoint import Checkpoint
from offload.plan import memory
from offload.plan.planner import Planner
from tests.conftest import run_config


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_v1_limit_minus_usage_with_page_cache_as_room(tmp_path):
    proc = tmp_path / "proc"
    write(tmp_path, {
        "proc": "4:memory:/jobs/a\n1:cpu:/\n0::/\n",
        "cg/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "cg/memory/memory.usage_in_bytes": "100\n", "cg/memory/memory.stat": "total_inactive_file 0\n",
        "cg/memory/jobs/a/memory.limit_in_bytes": str(2 << 30),
        "cg/memory/jobs/a/memory.usage_in_bytes": str(1 << 30),
        "cg/memory/jobs/a/memory.stat": f"cache 5\ntotal_inactive_file {256 << 20}\n",
    })
    assert memory.cgroup_room(proc, tmp_path / "cg") == (2 << 30) - (1 << 30) + (256 << 20)


def test_v2_tightest_ancestor_wins_and_no_limit_is_none(tmp_path):
    proc = tmp_path / "proc"
    write(tmp_path, {
        "proc": "0::/user/job\n",
        "cg/user/memory.max": str(1 << 30), "cg/user/memory.current": str(512 << 20),
        "cg/user/memory.stat": "inactive_file 0\n",
        "cg/user/job/memory.max": "max\n", "cg/user/job/memory.current": str(512 << 20),
        "cg/user/job/memory.stat": "inactive_file 0\n",
    })
    assert memory.cgroup_room(proc, tmp_path / "cg") == 512 << 20
    (tmp_path / "cg/user/memory.max").write_text("max\n")
    assert memory.cgroup_room(proc, tmp_path / "cg") is None
    assert memory.cgroup_room(tmp_path / "absent", tmp_path / "cg") is None


def test_ram_available_is_capped_by_the_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_room", lambda: 300 << 20)
    assert memory.ram_available() == min(300 << 20, memory.psutil.virtual_memory().available)


def test_cpu_device_auto_tiers_share_one_ram(monkeypatch):
    """On a CPU device the gpu and cpu tiers are one RAM: `auto` gets what the other tier leaves, never the whole
    of it twice (a plan from that would be refused, or killed by a container's limit)."""
    monkeypatch.setattr(memory, "ram_available", lambda: 1000 << 20)
    cpu = torch.device("cpu")
    both = memory.resolve_capacities(TiersConfig(GpuTierConfig(None), CpuTierConfig(None)), cpu)
    assert (both.gpu, both.cpu) == (800 << 20, 0)
    one = memory.resolve_capacities(TiersConfig(GpuTierConfig(None), CpuTierConfig(300 << 20)), cpu)
    assert (one.gpu, one.cpu) == (500 << 20, 300 << 20)
    other = memory.resolve_capacities(TiersConfig(GpuTierConfig(600 << 20), CpuTierConfig(None)), cpu)
    assert (other.gpu, other.cpu) == (600 << 20, 200 << 20)


def test_auto_tiers_leave_free_what_a_first_run_compiles(tiny_llama, monkeypatch, caplog):
    """numba keeps what a fresh install's first run compiles for the process's life (~300 MiB for the dense kernels,
    ~650 MiB with the packed ones): a CPU run's auto tiers leave that free, and say so, while numba's cache lacks the
    kernels the run uses; explicit capacities are the user's."""
    monkeypatch.setattr(memory, "ram_available", lambda: 2000 << 20)
    monkeypatch.setattr(memory.fused, "layers_compiled", lambda packed=None: not packed)  # dense cached, packed not
    cpu, mib = torch.device("cpu"), 2**20

    def gpu(**keys) -> int:
        caplog.clear()
        monkeypatch.setattr(memory, "_told", set())  # told once a process: each call here as a new one
        tiers = keys.pop("tiers", {"gpu": {"capacity": "auto"}, "cpu": {"capacity": "auto"}})
        return memory.run_capacities(OffloadConfig.load(run_config(tiny_llama, tiers=tiers, **keys)), cpu).gpu

    assert gpu() == 1600 * mib and not caplog.records  # dense: compiled already
    for keys in ({"weights": {"quantization": "int4"}}, {"speculative": {"draft": "self-int8"}}):
        assert gpu(**keys) == int((2000 - 650) * mib * 0.8), keys
        assert "not compiled yet" in caplog.text and "650.0 MiB" in caplog.text
    caplog.clear()  # told once a process: a later plan of another format says nothing, nor one told not to
    monkeypatch.setattr(memory.fused, "layers_compiled", lambda packed=None: False)
    dense = OffloadConfig.load(run_config(tiny_llama, tiers={"gpu": {"capacity": "auto"}}))
    memory.run_capacities(dense, cpu)
    monkeypatch.setattr(memory, "_told", set())
    assert memory.run_capacities(dense, cpu, tell=False).gpu == int((2000 - 300) * mib * 0.8)
    assert not caplog.records  # (`plan`'s table of weight formats plans so: their reserves are not the run's)
    explicit = {"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "auto"}}
    assert gpu(tiers=explicit, weights={"quantization": "int8"}) == 1 << 30  # the cpu tier leaves it: 0 here
    monkeypatch.setattr(memory.fused, "layers_compiled", lambda packed=None: None)  # numba's cache unreadable
    assert gpu(weights={"quantization": "int4"}) == 1600 * mib and not caplog.records


def test_a_plan_that_cannot_fit_beside_the_compile_reserve_takes_it_back(tiny_llama, tmp_path, monkeypatch, caplog):
    """A first run in little RAM (a 1 GiB cgroup, the 1.7B int4) was refused with the reserve held, where a later run
    fits: the plan takes what its smallest plan needs of the reserve (saying the compiling may not fit), streaming
    from its disk tier, before computing in a narrower dtype; without a disk tier RAM must hold every weight: all of
    the reserve goes back."""
    kib = 2**10
    ram = memory.fused.COMPILING[False] + 512 * kib  # 0.8 x 512 KiB beside the dense kernels' reserve: too little
    monkeypatch.setattr(memory, "ram_available", lambda: ram)
    monkeypatch.setattr(memory.fused, "layers_compiled", lambda packed=None: False)
    for disk in (True, False):
        monkeypatch.setattr(memory, "_told", set())
        caplog.clear()
        tiers = {"gpu": {"capacity": "auto"}, "cpu": {"capacity": 0}} | ({"disk": {"path": str(tmp_path)}} if disk
                                                                         else {})
        config = OffloadConfig.load(run_config(tiny_llama, tiers=tiers))
        caps = memory.run_capacities(config, torch.device("cpu"))
        assert caps.held == int(ram * 0.8) - int(512 * kib * 0.8) and caps.gpu == int(512 * kib * 0.8)
        planner = Planner(config, Checkpoint(tiny_llama).config, torch.float32, torch.device("cpu"), caps)
        rp = planner.run_plan()
        assert rp.plan.used("gpu") > caps.gpu and rp.compute_dtype == torch.float32  # the reserve's room, float32
        assert planner.caps.gpu + planner.caps.held == int(ram * 0.8)
        assert (0 < planner.caps.held < caps.held) if disk else planner.caps.held == 0  # the rest still kept
        assert "takes what its smallest plan needs" in caplog.text and "not compiled yet" in caplog.text
