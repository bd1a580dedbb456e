"""The cost model: predict a plan's time per forward pass by simulating the prefetch pipeline.

Inputs are plain numbers: per-group compute seconds (the caller derives them from the model
and a calibration), each link's bytes per second, and the `Plan`. The simulation replays what
`schedulers.prefetch` does — one loader walking the streamed groups in order, reads into a
staging slot or straight into a ring slot, copies on the transfer engine's one copy stream,
`depth + 1` ring slots freed when the compute that read them ends, compute in pass order
waiting only for the group it needs — for a few passes, and reports the steady-state pass: its time, each link's busy
time, the exposed (not overlapped) transfer time per group, and the bottleneck.

It knows groups, bytes, links and seconds; it knows nothing about models (`offload.plan.predict`
turns a model and a calibration into its inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schedulers.plan import Plan
from storage.units import fmt_bytes

#: link names, as in the calibration file and the trace summary
DISK, H2D = "disk read", "host->device"


@dataclass
class Prediction:
    step_s: float  # one steady-state forward pass
    compute_s: float  # compute busy time in the pass
    link_s: dict[str, float]  # busy time per link in the pass
    exposed_s: float  # compute idle, waiting for bytes
    exposed_by_group: dict[str, float] = field(default_factory=dict)

    @property
    def bottleneck(self) -> str:
        loads = {"compute": self.compute_s, **self.link_s}
        return max(loads, key=loads.get)

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "link_s": dict(self.link_s),
                "exposed_s": self.exposed_s, "bottleneck": self.bottleneck}


def simulate(plan: Plan, compute_s: dict[str, float], bandwidth: dict[str, float], passes: int = 8,
             share: float | None = None, side: dict[str, tuple[int, int]] | None = None) -> Prediction:
    """Replay `passes` forward passes of the plan's pipeline; report the mean of the second half (steady state).

    Experts loaded on demand (`plan.on_demand`) are not prefetched in this model: compute waits for the expected
    bytes of each one (`share` of them routed, default `plan.routed_share`, times the cache's miss rate).
    `side`: a group's cold KV bytes a pass, (from the host tier, from disk), fetched by the one side thread
    (`schedulers.side`: in pass order, at most `depth + 1` groups ahead of compute; host bytes at memcpy's rate, disk
    bytes on the disk the weights' loads read too); the group's compute waits for them."""
    miss = (plan.routed_share if share is None else share) * (1.0 - plan.hit_rate)
    order = list(plan.order)
    streamed = plan.streamed
    n, ring = len(streamed), max(plan.ring_slots, 1)
    loads = [(p, g) for p in range(passes + 1) for g in streamed]  # one pass more: prefetch runs ahead

    stage_free = [0.0] * max(plan.stage_slots, 1)
    loader = copy_stream = 0.0
    stager, staged = [0.0], [0]  # the staging reader's clock, and how many loads it staged
    ready: dict[int, float] = {}  # load index -> its bytes are on the device
    link_busy: dict[str, list[tuple[float, float]]] = {DISK: [], H2D: []}
    released: dict[int, float] = {}
    disk = [0.0]  # when the disk is next free: the loader's and the side thread's reads take turns

    def read_disk(t0: float, size: float) -> float:
        t0 = max(t0, disk[0])
        disk[0] = t1 = t0 + size / bandwidth[DISK]
        link_busy[DISK].append((t0, t1))
        return t1

    def start_load(k: int) -> None:
        nonlocal loader, copy_stream
        group = loads[k][1]
        size = plan.sizes[group]
        route = plan.route(group)
        # the slot is free once load k - ring was computed (known: compute runs ahead of this call)
        free_at = released.get(k - ring, 0.0) if k >= ring else 0.0
        if route[0] == "disk" and route[1] == "cpu":  # disk -> stage (the stager runs ahead) -> device
            s = staged[0] % len(stage_free)
            staged[0] += 1
            t1 = read_disk(max(stager[0], stage_free[s], free_at if plan.depth == 0 else 0.0), size)  # depth 0:
            stager[0] = t1  # no read-ahead
            loader = max(loader, t1, free_at)  # the loader lands loads in order, each in its ring slot
            c0 = max(copy_stream, loader)
            c1 = c0 + size / bandwidth[H2D]
            link_busy[H2D].append((c0, c1))
            copy_stream, stage_free[s], ready[k] = c1, c1, c1
        elif route[0] == "disk":  # CPU device: disk -> ring slot
            t1 = read_disk(max(loader, free_at), size)
            loader, ready[k] = t1, t1
        else:  # host -> device
            t0 = max(loader, free_at)
            loader = t0
            c0 = max(copy_stream, t0)
            c1 = c0 + size / bandwidth[H2D]
            link_busy[H2D].append((c0, c1))
            copy_stream, ready[k] = c1, c1

    clock, k_next, k = 0.0, 0, 0
    pass_start = [0.0] * passes
    exposed: dict[str, float] = {}
    exposed_total = [0.0] * passes
    compute_total = [0.0] * passes
    side, side_clock, lead = side or {}, 0.0, plan.depth + 1
    for p in range(passes):
        pass_start[p] = clock
        finished: list[float] = []  # when compute was done with each group of this pass, in order
        for g in order:
            if g in plan.rows_only:
                continue
            if g in side:  # its cold KV: once compute is at most `lead` groups behind it, after the job before
                host, cold = side[g]
                at = len(finished) - lead
                t0 = max(side_clock, pass_start[p] if at <= 0 else finished[at - 1]) + host / bandwidth["memcpy"]
                side_clock = read_disk(t0, cold) if cold else t0
                wait = max(side_clock - clock, 0.0)
                if p >= passes // 2:
                    exposed[g] = exposed.get(g, 0.0) + wait
                exposed_total[p] += wait
                clock += wait
            if g in plan.on_demand:
                size, route = plan.sizes[g] * miss, plan.route(g)
                t = 0.0
                if route[0] == "disk":
                    link_busy[DISK].append((clock, clock + size / bandwidth[DISK]))
                    t += size / bandwidth[DISK]
                if route[-1] == "gpu" and plan.copy_to_device:
                    link_busy[H2D].append((clock + t, clock + t + size / bandwidth[H2D]))
                    t += size / bandwidth[H2D]
                if p >= passes // 2:
                    exposed[g] = exposed.get(g, 0.0) + t
                exposed_total[p] += t
                clock += t + compute_s.get(g, 0.0)
                compute_total[p] += compute_s.get(g, 0.0)
                finished.append(clock)
                continue
            if not plan.is_resident(g):
                # the loader can issue every load whose ring slot is (or will be) released by now
                while k_next < len(loads) and (k_next < ring or (k_next - ring) in released):
                    start_load(k_next)
                    k_next += 1
                wait = max(ready[k] - clock, 0.0)
                if p >= passes // 2:
                    exposed[g] = exposed.get(g, 0.0) + wait
                exposed_total[p] += wait
                clock += wait
                clock += compute_s.get(g, 0.0)
                released[k] = clock
                k += 1
            else:
                clock += compute_s.get(g, 0.0)
            compute_total[p] += compute_s.get(g, 0.0)
            finished.append(clock)
    warm = passes // 2
    lo, hi, n = pass_start[warm], clock, passes - warm
    busy = {link: sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans) / n
            for link, spans in link_busy.items() if spans}
    return Prediction((hi - lo) / n, sum(compute_total[warm:]) / n, busy, sum(exposed_total[warm:]) / n,
                      {g: t / n for g, t in exposed.items()})


def link_bound(plan: Plan, bandwidth: dict[str, float]) -> dict[str, float]:
    """Seconds each link needs per pass if it never idles (the physical bound per link)."""
    out: dict[str, float] = {}
    for g in plan.streamed:
        route = plan.route(g)
        if route[0] == "disk":
            out[DISK] = out.get(DISK, 0.0) + plan.sizes[g] / bandwidth[DISK]
        if route[-2:] == ("cpu", "gpu"):
            out[H2D] = out.get(H2D, 0.0) + plan.sizes[g] / bandwidth[H2D]
    return out


def explain(plan: Plan, pred: Prediction, links: dict[str, float]) -> list[str]:
    """Lines: the split of a step by link and compute, and the bound per link."""
    bound = link_bound(plan, links)
    parts = [f"compute {1000 * pred.compute_s:.0f} ms"] + [
        f"{link} {1000 * t:.0f} ms ({fmt_bytes(plan_bytes(plan, link), 'MiB', digits=1)} at "
        f"{links[link] / 1e9:.1f} GB/s)" for link, t in bound.items()]
    return [f"busy per step: {', '.join(parts)}",
            f"exposed transfer {1000 * pred.exposed_s:.0f} ms; bottleneck: {pred.bottleneck}"]


def plan_bytes(plan: Plan, link: str) -> int:
    moved = plan.bytes_per_step()
    if link == "disk read":
        return moved.get("disk->cpu", 0) + moved.get("disk->gpu", 0)
    return moved.get("cpu->gpu", 0)
