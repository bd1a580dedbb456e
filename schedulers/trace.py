"""Where the time went: Chrome/Perfetto trace files, and the summary read from the spans.

    write_chrome(path, spans, counters, meta)   a trace that opens in ui.perfetto.dev and chrome://tracing:
                                                one track per link and per compute stream, spans named by
                                                group and step, args with bytes and achieved GB/s, counter
                                                tracks for bytes resident per tier
    load_chrome(path) -> (spans, counters, meta)
    summarize(spans, steps, calibrated) -> Summary
        per link: bytes moved, busy time, achieved bandwidth and its fraction of the calibrated one;
        compute busy time; stall time (compute idle waiting for bytes) attributed to the link that
        caused it, per group and in total; the overlap of transfers with compute; and time per step
        split into compute / exposed transfer / other.

A stall on load k is charged first to the stages of load k itself that were still running
(its disk read, its host->device copy), then to a link that was busy with earlier loads (k
was queued behind them), and what is left to "schedule" (the ring was full: depth too small,
or the loader thread was late). This module knows spans and links, never models.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from schedulers.timeline import Span, busy_time, merge_intervals, overlap_time
from storage.units import fmt_bytes

#: Chrome thread ids, one per track, in display order.
TRACK_TIDS = {"compute": 1, "stall": 2, "disk-read": 3, "h2d": 4, "d2h": 5, "disk-write": 6,
              "kv-spill": 7, "kv-fetch": 8}
#: The link each transfer track measures.
LINKS = {"disk-read": "disk read", "h2d": "host->device", "d2h": "device->host", "disk-write": "disk write",
         "kv-spill": "kv spill", "kv-fetch": "kv fetch"}
PID = 1
#: the links a stall may have queued behind, upstream first
QUEUED = ("disk-read", "h2d", "d2h", "kv-fetch", "kv-spill", "disk-write")


@dataclass(frozen=True, slots=True)
class Counter:
    name: str
    t: float  # seconds since the timeline origin
    values: dict[str, float]


# ----------------------------------------------------------------------------- Chrome trace files
def to_chrome(spans: list[Span], counters: list[Counter] = (), meta: dict[str, Any] | None = None) -> dict:
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "ts": 0, "args": {"name": "offload"}},
    ]
    for track, tid in TRACK_TIDS.items():
        events.append({"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "ts": 0, "args": {"name": track}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "ts": 0,
                       "args": {"sort_index": tid}})
    for s in spans:
        dur = max(s.end - s.start, 0.0)
        args: dict[str, Any] = {"step": s.step, "bytes": s.nbytes}
        if s.nbytes and dur > 0:
            args["GB/s"] = round(s.nbytes / dur / 1e9, 3)
        if s.slot is not None:
            args["slot"] = s.slot
        args.update(s.args)
        events.append({"ph": "X", "name": s.name, "cat": s.track, "pid": PID,
                       "tid": TRACK_TIDS.get(s.track, len(TRACK_TIDS) + 1),
                       "ts": round(max(s.start, 0.0) * 1e6, 3), "dur": round(dur * 1e6, 3), "args": args})
    for c in counters:
        events.append({"ph": "C", "name": c.name, "pid": PID, "tid": 0, "ts": round(max(c.t, 0.0) * 1e6, 3),
                       "args": dict(c.values)})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"offload": meta or {}}}


def write_chrome(path: str | Path, spans: list[Span], counters: list[Counter] = (),
                 meta: dict[str, Any] | None = None) -> None:
    Path(path).write_text(json.dumps(to_chrome(spans, counters, meta)))


def load_chrome(path: str | Path) -> tuple[list[Span], list[Counter], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    tracks = {tid: track for track, tid in TRACK_TIDS.items()}
    spans, counters = [], []
    for e in events:
        if e.get("ph") == "X":
            args = dict(e.get("args", {}))
            step, nbytes, slot = args.pop("step", 0), args.pop("bytes", 0), args.pop("slot", None)
            args.pop("GB/s", None)
            start = e["ts"] / 1e6
            spans.append(Span(e.get("cat") or tracks.get(e["tid"], "other"), e["name"], step, start,
                              start + e.get("dur", 0) / 1e6, nbytes, slot, args))
        elif e.get("ph") == "C":
            counters.append(Counter(e["name"], e["ts"] / 1e6, dict(e.get("args", {}))))
    meta = data.get("otherData", {}).get("offload", {}) if isinstance(data, dict) else {}
    return spans, counters, meta


def check_chrome(data: dict) -> list[str]:
    """Problems that would stop a trace viewer (empty list: fine)."""
    problems = []
    for i, e in enumerate(data.get("traceEvents", [])):
        for key in ("ph", "ts", "pid", "tid"):
            if key not in e:
                problems.append(f"event {i} has no {key!r}")
        if e.get("ph") == "X" and "dur" not in e:
            problems.append(f"complete event {i} has no 'dur'")
        if e.get("ts", 0) < 0 or e.get("dur", 0) < 0:
            problems.append(f"event {i} has a negative time")
    return problems


# ----------------------------------------------------------------------------- summary
@dataclass
class LinkStats:
    link: str
    bytes: int
    busy_s: float
    bytes_per_s: float
    calibrated_bytes_per_s: float | None = None

    @property
    def fraction_of_calibrated(self) -> float | None:
        if not self.calibrated_bytes_per_s:
            return None
        return self.bytes_per_s / self.calibrated_bytes_per_s


@dataclass
class Summary:
    steps: int
    wall_s: float  # sum of the steps' durations
    compute_s: float  # compute busy time
    links: list[LinkStats]
    stall_s: float
    stall_by_cause: dict[str, float]
    stall_by_group: dict[str, dict[str, float]]
    overlap: float  # fraction of transfer busy time hidden under compute
    split_s: dict[str, float] = field(default_factory=dict)  # compute / exposed transfer / other, whole run
    experts: dict[str, Any] = field(default_factory=dict)  # the expert cache's counts (`expert_counts`)

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {k: v / n for k, v in self.split_s.items()}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for link, stats in zip(d["links"], self.links):
            link["fraction_of_calibrated"] = stats.fraction_of_calibrated
        d["per_step_s"] = self.per_step()
        return d


def _clip(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(hi, b) - max(lo, a)) for lo, hi in intervals)


def summarize(spans: list[Span], steps: range | None = None,
              calibrated: dict[str, float] | None = None) -> Summary:
    """Summarise the spans of the given steps (all by default); `calibrated`: link -> bytes per second."""
    if steps is not None:
        spans = [s for s in spans if s.step in steps]
    by_track: dict[str, list[Span]] = {}
    for s in spans:
        by_track.setdefault(s.track, []).append(s)
    compute = by_track.get("compute", [])
    transfers = [s for t in LINKS for s in by_track.get(t, [])]
    links = []
    for track, link in LINKS.items():
        ss = by_track.get(track, [])
        if not ss:
            continue
        busy, nbytes = busy_time(ss), sum(s.nbytes for s in ss)
        links.append(LinkStats(link, nbytes, busy, nbytes / busy if busy > 0 else 0.0,
                               (calibrated or {}).get(link)))

    # stall attribution
    own: dict[tuple[int, str], list[Span]] = {}
    for s in transfers:
        if "k" in s.args:
            own.setdefault((s.args["k"], s.track), []).append(s)
    busy_links = {track: merge_intervals(by_track.get(track, [])) for track in LINKS}
    by_cause: dict[str, float] = {}
    by_group: dict[str, dict[str, float]] = {}
    for st in by_track.get("stall", []):
        a, b = st.start, st.end
        # queued links, upstream first; a wait on a side job (cold KV, `waits`) is charged to its own link first
        queued = sorted(QUEUED, key=lambda track: track != st.args.get("waits"))
        left = b - a
        charged: dict[str, float] = {}
        k = st.args.get("k")
        covered: list[tuple[float, float]] = []
        for track in LINKS:  # 1. the load's own stages
            for s in own.get((k, track), []):
                t = max(0.0, min(s.end, b) - max(s.start, a))
                if t > 0:
                    charged[LINKS[track]] = charged.get(LINKS[track], 0.0) + t
                    covered.append((max(s.start, a), min(s.end, b)))
        covered = _merge(covered)
        gaps = _gaps(covered, a, b)
        for lo, hi in gaps:  # 2. queued behind a link busy with other loads (upstream first)
            rest = [(lo, hi)]
            for track in queued:
                nxt = []
                for x, y in rest:
                    t = _clip(busy_links[track], x, y)
                    if t > 0:
                        charged[LINKS[track]] = charged.get(LINKS[track], 0.0) + t
                        sub = _gaps(_merge([(max(p, x), min(q, y)) for p, q in busy_links[track]
                                            if q > x and p < y]), x, y)
                        nxt += sub
                    else:
                        nxt.append((x, y))
                rest = nxt
            charged["schedule"] = charged.get("schedule", 0.0) + sum(y - x for x, y in rest)
        total = sum(charged.values())
        scale = left / total if total > 0 else 0.0
        for cause, t in charged.items():
            by_cause[cause] = by_cause.get(cause, 0.0) + t * scale
            g = by_group.setdefault(st.name, {})
            g[cause] = g.get(cause, 0.0) + t * scale
    stall = sum(s.duration for s in by_track.get("stall", []))

    # the steps' wall time: from the first to the last span of each step on the compute side
    per_step: dict[int, list[Span]] = {}
    for s in compute + by_track.get("stall", []):
        per_step.setdefault(s.step, []).append(s)
    wall = sum(max(s.end for s in ss) - min(s.start for s in ss) for ss in per_step.values())
    compute_s = busy_time(compute)
    overlap = overlap_time(transfers, compute) / busy_time(transfers) if transfers else 1.0
    split = {"compute": compute_s, "exposed transfer": stall, "other": max(wall - compute_s - stall, 0.0)}
    return Summary(len(per_step), wall, compute_s, links, stall, by_cause, by_group, overlap, split,
                   expert_counts(by_track.get("experts", [])))


def expert_counts(spans: list[Span]) -> dict[str, Any]:
    """The expert cache's spans (one per MoE layer per pass: hits, prefetched, misses, predicted, correct) ->
    totals, hit rates per layer, and the next-layer prediction's precision ({} without an expert cache)."""
    if not spans:
        return {}
    keys = ("hits", "prefetched", "misses", "predicted", "correct")
    per: dict[str, dict[str, int]] = {}
    for s in spans:
        c = per.setdefault(s.name, dict.fromkeys(keys, 0))
        for k in keys:
            c[k] += int(s.args.get(k, 0))
    tot = {k: sum(c[k] for c in per.values()) for k in keys}
    routed = tot["hits"] + tot["prefetched"] + tot["misses"]

    def rate(c: dict[str, int]) -> float:
        n = c["hits"] + c["prefetched"] + c["misses"]
        return round((c["hits"] + c["prefetched"]) / n, 4) if n else 0.0

    return {**tot, "routed": routed, "hit_rate": rate(tot),
            "cached_hit_rate": round(tot["hits"] / routed, 4) if routed else 0.0,
            "prediction_precision": round(tot["correct"] / tot["predicted"], 4) if tot["predicted"] else None,
            "per_layer_hit_rate": {g: rate(c) for g, c in sorted(per.items(), key=lambda kv: _layer_key(kv[0]))}}


def _layer_key(name: str) -> tuple[int, str]:
    head, _, tail = name.partition(".")
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _gaps(covered: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    gaps, t = [], a
    for x, y in covered:
        if x > t:
            gaps.append((t, min(x, b)))
        t = max(t, y)
    if t < b:
        gaps.append((t, b))
    return [(x, y) for x, y in gaps if y > x]


def format_summary(s: Summary, top: int = 5) -> str:
    n = max(s.steps, 1)
    ms = {k: 1000 * v / n for k, v in s.split_s.items()}
    lines = [f"{s.steps} steps, {1000 * s.wall_s / n:.1f} ms/step: compute {ms['compute']:.1f}, exposed transfer "
             f"{ms['exposed transfer']:.1f}, other {ms['other']:.1f}; {100 * s.overlap:.0f}% of transfer time hidden "
             "under compute"]
    if s.links:
        lines.append(f"  {'link':<14} {'bytes/step':>12} {'busy ms/step':>13} {'GB/s':>7} {'of calibrated':>14}")
        for link in s.links:
            frac = link.fraction_of_calibrated
            lines.append(f"  {link.link:<14} {fmt_bytes(link.bytes / n, 'MiB'):>13} {1000 * link.busy_s / n:>13.1f} "
                         f"{link.bytes_per_s / 1e9:>7.2f} {('-' if frac is None else f'{100 * frac:.0f}%'):>14}")
    lines.append(f"  compute busy {1000 * s.compute_s / n:.1f} ms/step; stall {1000 * s.stall_s / n:.1f} ms/step"
                 + ("" if not s.stall_by_cause else " (" + ", ".join(
                     f"{cause} {1000 * t / n:.1f}" for cause, t in sorted(s.stall_by_cause.items(),
                                                                         key=lambda kv: -kv[1])) + ")"))
    if s.experts:
        e = s.experts
        layers = ", ".join(f"{g.removeprefix('layer.')} {100 * r:.0f}%" for g, r in e["per_layer_hit_rate"].items())
        lines.append(f"  expert cache: {e['routed']} routed, hit rate {100 * e['hit_rate']:.0f}% (cached "
                     f"{100 * e['cached_hit_rate']:.0f}%, prefetched {e['prefetched']}, on demand {e['misses']})"
                     + ("" if e["prediction_precision"] is None else
                        f"; next-layer prediction precision {100 * e['prediction_precision']:.0f}%")
                     + f"; per layer: {layers}")
    worst = sorted(s.stall_by_group.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    for group, causes in worst:
        lines.append(f"    {group:<10} stalls {1000 * sum(causes.values()) / n:.1f} ms/step: " + ", ".join(
            f"{c} {1000 * t / n:.1f}" for c, t in sorted(causes.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)
