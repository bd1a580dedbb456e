"""What speculative decoding should gain: tokens per verify pass, the speed-up, the best draft length.

With a per-token acceptance rate `alpha` (the chance the target keeps a draft token given it
kept the ones before), a chain of `k` draft tokens yields on average

    E(k) = (1 - alpha^(k+1)) / (1 - alpha)      tokens per verify pass (the +1: the target's own token)

for `k` draft passes and one target pass over k+1 tokens. Against plain decoding (one token per
target pass) the speed-up is E(k) * t_plain / (k * t_draft + t_verify(k)) (Leviathan et al. 2023,
eq. 1 and theorem 3.8). When the target streams its weights, t_verify(k) is close to t_plain:
the bytes move once whatever the token count, which is why a long chain pays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.config import OffloadConfig, SpeculativeConfig
from offload.model import kernels
from offload.model.config import ModelConfig
from offload.plan.calibrate import Calibration
from offload.plan.costmodel import simulate
from offload.plan.planner import AUTO_KV_TOKENS, Planner
from offload.plan.predict import Workload, compute_seconds, predict_decode
from schedulers.plan import Capacities, Plan
from storage.errors import CapacityError
from storage.units import blocks_for, fmt_bytes

#: longest chain `tokens: auto` considers
MAX_AUTO_TOKENS = 16
#: the acceptance rate `tokens: auto` assumes when it decides, before any token, whether a draft can pay: a
#: good draft's (SmolLM2-135M greedy, self-int8 / self-int4 drafts: see README "Speculative decoding"). A run
#: that keeps its draft re-chooses the chain length from the acceptance it measures.
PLAN_ALPHA = 0.8
#: The least speed-up the plan must predict before `tokens: auto` takes a draft: on a shared host the plan's step is
#: within ~20% of a run's, so a smaller predicted gain can be a loss. (SmolLM2-135M, bf16, a 2-core Zen 4, 64 new
#: tokens, 3 rounds alternating with plain decoding: self-int8 predicted x1.07 (1 draft token a pass) and ran 0.88 /
#: 1.02 / 0.81 of it, self-int4 predicted x1.17 (2) and ran 0.80 / 1.00 / 0.72; 4 int8 draft tokens 1.07 / 1.10 /
#: 0.99.)
AUTO_MIN_SPEEDUP = 1.2


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens one verify pass of `k` draft tokens yields (acceptance `alpha` per token)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class SpecPrediction:
    tokens: int  # draft tokens per pass
    tokens_per_pass: float  # expected tokens each verify pass yields
    step_s: float  # one speculative step: `tokens` draft passes and one verify pass
    speedup: float  # tokens per second against plain decoding (one token per target pass)


def predict(alpha: float, k: int, t_draft: float, t_verify: Callable[[int], float], t_plain: float
            ) -> SpecPrediction:
    """`t_draft`: one draft pass; `t_verify(k)`: a target pass over k+1 tokens; `t_plain`: over 1 token."""
    step = k * t_draft + t_verify(k)
    e = expected_tokens(alpha, k)
    return SpecPrediction(k, e, step, e * t_plain / step)


def choose_tokens(alpha: float, t_draft: float, t_verify: Callable[[int], float], t_plain: float,
                  most: int = MAX_AUTO_TOKENS) -> SpecPrediction:
    """The chain length (0..most) with the highest predicted speed-up; ties go to the shorter chain.

    0 means plain decoding: the draft costs more than its accepted tokens save."""
    best = SpecPrediction(0, 1.0, t_plain, 1.0)
    for k in range(1, most + 1):
        p = predict(alpha, k, t_draft, t_verify, t_plain)
        if p.speedup > best.speedup * 1.005:
            best = p
    return best


@dataclass(frozen=True)
class SpecGain:
    """What a draft buys a run against plain decoding without one, from the cost model: pass times of the
    draft, of the target beside it (its device share taken by the draft), of the target alone."""

    t_draft: float  # one draft pass (batch 1)
    t_plain: float  # one target pass over one token, the draft resident beside it
    t_alone: float  # the same without a draft: what plain decoding costs
    verify: Callable[[int], float]  # k -> a target pass over k+1 tokens / over one

    def at(self, alpha: float, tokens: int | None = None) -> SpecPrediction:
        """The speed-up against plain decoding without a draft at acceptance `alpha`: of `tokens` draft tokens
        a pass, else of the best chain (0: plain decoding, x1)."""
        t_verify = lambda k: self.t_plain * self.verify(k)  # noqa: E731
        if tokens:
            return predict(alpha, tokens, self.t_draft, t_verify, self.t_alone)
        return choose_tokens(alpha, self.t_draft, t_verify, self.t_alone)

    def plain_note(self, alpha: float = PLAN_ALPHA) -> str | None:
        """A sentence saying why `tokens: auto` runs plain, or None when the best chain is predicted to pay at least
        `AUTO_MIN_SPEEDUP`."""
        p = self.at(alpha)
        if p.tokens and p.speedup >= AUTO_MIN_SPEEDUP:
            return None
        best = max(range(1, MAX_AUTO_TOKENS + 1), key=lambda k: self.at(alpha, k).speedup)
        x = self.at(alpha, best).speedup
        short = f", under the x{AUTO_MIN_SPEEDUP:.1f} a draft must promise to outlast the plan's error" \
            if x >= 1 else ""
        return (f"speculative.tokens: auto runs plain decoding (no draft): the plan predicts x{x:.2f} of plain "
                f"decoding at best ({best} draft tokens a pass, acceptance {alpha:.1f}; a draft pass "
                f"{1000 * self.t_draft:.0f} ms, a plain step {1000 * self.t_alone:.0f} ms){short}; give "
                "speculative.tokens a number to speculate anyway")


def gain(target: Planner, alone: Planner, draft: Planner, cal: Calibration) -> SpecGain:
    """The cost model's `SpecGain` from the planners of the target beside its draft, of the target alone and
    of the draft (pass times of batch 1, packed matrices at their calibrated compute speed)."""
    device_type, dtype_bytes = target.device.type, target.dtype.itemsize

    def step(p: Planner) -> float:
        plan = p.run_plan().plan
        return predict_decode(plan, p.cfg, cal, device_type, Workload(), dtype_bytes, p.compute_sizes).step_s

    plan = target.run_plan().plan
    cost = verify_cost(plan, target.cfg, cal, device_type, dtype_bytes, target.compute_sizes)
    return SpecGain(step(draft), step(target), step(alone), cost)


def verify_cost(plan: Plan, cfg: ModelConfig, cal: Calibration, device_type: str, dtype_bytes: int,
                sizes: dict[str, int] | None = None) -> Callable[[int], float]:
    """k -> the cost model's time for a target pass over k+1 tokens, relative to a pass over one.

    On a CPU with row-invariant kernels (`offload.model.kernels`) a verify pass is one pass over k+1 tokens;
    elsewhere it multiplies each of its k+1 token columns as its own product (the bits of a plain step:
    `layout.column_groups`), so its compute is k+1 single-row passes' while its bytes move once."""
    one = compute_seconds(plan, cfg, cal, device_type, 1, Workload().context, 1, dtype_bytes, sizes)

    def step(columns: int) -> float:
        if device_type == "cpu" and kernels.ROW_INVARIANT:
            comp = compute_seconds(plan, cfg, cal, device_type, columns, Workload().context, 1, dtype_bytes, sizes)
            return simulate(plan, comp, cal.links).step_s
        return simulate(plan, {g: columns * s for g, s in one.items()}, cal.links).step_s

    base = step(1)

    @functools.cache
    def cost(k: int) -> float:
        return step(k + 1) / base if base > 0 else 1.0

    return cost


def reserve_draft(config: OffloadConfig, caps: Capacities, draft_gpu_bytes: int, draft_block_bytes: int
                  ) -> Capacities:
    """The capacities left to the target once the resident draft is placed (it is placed first).

    `draft_gpu_bytes`: the draft plan's device bytes (weights, workspace); its KV pool holds one block for
    every block of the target's (device, host and disk), so whatever the target admits fits the draft."""
    blocks = mirror_blocks(config)
    if caps.gpu is None:
        return dataclasses.replace(caps, kv_blocks=blocks)
    kv = config.kv_cache
    least = (kv.gpu_blocks or blocks_for(AUTO_KV_TOKENS, kv.block_size)) + (kv.cpu_blocks or 0) + (kv.disk_blocks or 0)
    if draft_gpu_bytes + blocks * draft_block_bytes >= caps.gpu:  # no room to mirror automatic cold tiers: none
        blocks = least
    need = draft_gpu_bytes + blocks * draft_block_bytes
    if need >= caps.gpu:
        raise CapacityError(f"speculative.draft: the draft needs {fmt_bytes(need, 'MiB')} resident on the device but "
                            f"tiers.gpu.capacity is {fmt_bytes(caps.gpu, 'MiB')}; raise it or choose a smaller draft")
    return dataclasses.replace(caps, gpu=caps.gpu - need, kv_blocks=blocks)


def mirror_blocks(config: OffloadConfig) -> int:
    """KV blocks the draft's own pool holds: one for every block the target may hold in all tiers. With explicit
    device and host counts, their sum (an automatic disk tier then gets none); otherwise at least
    `AUTO_KV_TOKENS` tokens, within which the target's device pool and automatic cold KV tiers are planned
    (`Capacities.kv_blocks`), so the cold tiers still hold what the device pool cannot."""
    kv = config.kv_cache
    explicit = (kv.gpu_blocks or 0) + (kv.cpu_blocks or 0) + (kv.disk_blocks or 0)
    auto = kv.gpu_blocks is None or (config.tiers is not None and kv.cpu_blocks is None)
    return max(explicit, blocks_for(AUTO_KV_TOKENS, kv.block_size)) if auto else explicit


def without_draft(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
    """The target's plan had speculative decoding been off (the device tier all its own): what the draft's
    resident bytes cost the target, e.g. layers that now stream every pass."""
    return Planner(config.replace(speculative=SpeculativeConfig()), cfg, dtype, device).run_plan()


def streaming_note(with_draft: Plan, alone: Plan) -> str | None:
    """A warning when the draft's device bytes make the target stream what it would otherwise hold."""
    extra = sum(with_draft.sizes[g] for g in with_draft.streamed) - sum(alone.sizes[g] for g in alone.streamed)
    if extra <= 0:
        return None
    return (f"speculative.draft: the draft's resident bytes make the target move {fmt_bytes(extra, 'MiB', 1)} more per "
            f"pass than it would without a draft ({len(with_draft.streamed)} streamed groups instead of "
            f"{len(alone.streamed)}); speculation must make up for that: raise tiers.gpu.capacity, or compare with "
            "speculative.draft: none")

