"""What a decode step costs beyond what the planner's probes time (`offload.plan.probe`: the layers, the pass's KV
step and RoPE): the generation loop around each pass (sampling, stops, results), the embedding, the final norm and
the head's calls, the resident layers' wrapper. Timed by decoding with a tiny model through the real engine, less
what the calibration says that model's passes cost; on a CPU also with the caches emptied before every step, as a
model larger than them empties them (small torch ops cost several times more then). The planner adds it to every
pass (`Calibration.pass_overhead_s`). `offload.plan.calibrate.calibrate` calls it where a caller hands it over (the
plan cannot import the runtime)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from offload.plan.calibrate import Calibration
from offload.plan.probe import evictor
from offload.runtime.runner import Runner
from offload.testing.make_model import make_model
from offload.weights.groups import group_layout

#: decode steps a timing averages over (the best of `REPEAT` timings)
STEPS, REPEAT = 16, 5


#: the tiny model's prompt: one prefill pass of 16 tokens
TINY_PROMPT = [1] + [3 + i for i in range(15)]


@contextmanager
def tiny_runner(device_type: str, dtype: str, quantization: str = "none") -> Iterator[tuple[Runner, Path]]:
    """(runner, directory) of a tiny Llama-shaped model written into a temporary directory, in `dtype`, its matrices
    dense ("none") or packed (int8, int4: its intermediate size then 384, which group size 64 divides); no prefix
    cache, prefill passes of 16 tokens (`TINY_PROMPT` in one pass: no 512-token workspace, 67 MB)."""
    with tempfile.TemporaryDirectory(prefix="offload-tiny-") as tmp:
        make_model(tmp, "llama", "tiny", dtype=dtype,
                   overrides=None if quantization == "none" else {"intermediate_size": 384})
        config = {"model": tmp, "device": device_type, "dtype": dtype, "kv_cache": {"prefix_cache": "off"},
                  "activations": {"prefill_chunk": 16}, "weights": {"quantization": quantization}}
        with Runner.from_config(config) as runner:
            yield runner, Path(tmp)


def engine_overhead_s(cal: Calibration, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """{"engine_overhead_s": seconds a decode step of the tiny model costs beyond its calibrated passes, caches as
    the step left them; on a CPU also "cold_engine_overhead_s": the same after emptying the caches before every
    step}. Never negative: a calibration that already over-counts the tiny model's passes adds nothing."""
    with tiny_runner(device.type, str(dtype).removeprefix("torch.")) as (runner, tmp):
        layers, layer = runner.cfg.num_layers, group_layout(runner.cfg, "layer.0", dtype).nbytes  # (the plan's size)
        weights = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))

        def step_s(on_token=None) -> float:
            res = runner.generate([TINY_PROMPT], max_new_tokens=STEPS, stop_on_eos=False, on_token=on_token)[0]
            return res.stats.decode_only_ms_per_step / 1e3

        step_s()  # warm-up: first use of the kernels, page faults
        hot = min(step_s() for _ in range(REPEAT))
        out = {"engine_overhead_s": max(0.0, hot - planned_pass_s(cal, device.type, layers, layer, weights, None))}
        if device.type == "cpu":  # (the callback runs between steps, outside a step's time)
            flush = evictor()
            cold = min(step_s(lambda *_: flush()) for _ in range(REPEAT))
            planned = planned_pass_s(cal, device.type, layers, layer, weights, float("inf"))
            out["cold_engine_overhead_s"] = max(out["engine_overhead_s"], cold - planned)
    return out


def planned_pass_s(cal: Calibration, device_type: str, layers: int, layer: int, weights: int,
                   reads: float | None) -> float:
    """What the calibration says one decode pass of a model of `layers` layers of `layer` bytes and `weights` bytes
    in all costs beside the engine: its layers (`Calibration.layer_seconds`), the pass's bookkeeping and the other
    bytes (`reads` past the cache: the cold columns, where the table has them)."""
    return (layers * cal.layer_seconds(device_type, 1, layer, reads)
            + cal.pass_overhead_s(device_type, 1, reads, engine=False)
            + max(weights - layers * layer, 0) / cal.weight_bytes_per_s(device_type, 1, reads))
