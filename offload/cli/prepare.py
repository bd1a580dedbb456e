"""What a command checks and does before it loads a model's weights.

    config = load_config(args.config, args.model)     # --model: a directory here, next to the YAML, or a Hub id
    cfg = model_config(config)                        # config.json alone
    require_chat(config.model)                        # chat / run --chat: a template and a tokenizer, or refuse
    check_new_tokens(cfg, args.max_new_tokens)        # a --max-new-tokens no prompt could fit beside
    before_run(config)                                # a missing store planned and converted (a bar), then a
                                                      # fresh install's CPU kernels compiled in child processes
    plan_for(config, cfg, dtype, device)              # the planner a run uses (`offload plan` shows its plan)

Each check reads small files (config.json, the tokenizer files), so a mistake costs a second, not a
conversion of the store or the minutes that filling the memory homes takes. The runner checks the
same things again (the context through `offload.runtime.requests.Context`); this module only makes
them early and says them in the command line's words. It prints to stderr only.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from offload.config import OffloadConfig, SpeculativeConfig
from offload.errors import ConfigError
from offload.model import hub
from offload.model.chat import ChatTemplate
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from offload.model.generic import generic_config, resolve_impl
from offload.plan.memory import compile_apart, packed_kernels
from offload.plan.planner import Planner, run_capacities
from offload.plan.speculative import reserve_draft
from offload.runtime.device import resolve_device, resolve_dtype
from offload.runtime.precompile import compile_kernels, stages_needed
from offload.runtime.ranks import launched
from offload.runtime.requests import Context
from offload.runtime.speculative import auto_gain, draft_config, draft_model_config
from offload.weights.convert import convert, open_tier_store
from offload.weights.groups import WeightFormat
from storage.store import StoreState, store_state


def load_config(config_path: str, model: str | None = None) -> OffloadConfig:
    """The YAML with `--model` applied. A path on the command line is relative to the directory it was typed
    in (else, as the YAML's own `model:`, to the YAML's directory); a value that is neither is a Hub id, and
    an error about it names the paths that were tried. A Hub checkpoint's small files (config.json, the
    tokenizer) are fetched now, for the checks before the weights load; the weights come when the runner
    starts (`OffloadConfig.fetched`)."""
    if model is None:
        return OffloadConfig.load(config_path).fetched(weights=False)
    here = Path(model).expanduser().resolve()
    beside = (Path(config_path).resolve().parent / Path(model).expanduser()).resolve()
    for path in (here, beside):
        if path.is_dir():
            return OffloadConfig.load(config_path, model=str(path)).fetched(weights=False)
    tried = f"neither {here} nor {beside} is a directory" if beside != here else f"{here} is not a directory"
    if not hub.is_hub_id(model):
        raise ConfigError(f"--model {model!r}: {tried}; give a checkpoint directory (config.json, *.safetensors) "
                          "or a Hub id like org/name")
    try:
        return OffloadConfig.load(config_path, model=model).fetched(weights=False)
    except ConfigError as e:
        if not str(e).startswith(f"model: {model}"):  # about another key of the YAML
            raise
        raise ConfigError(f"--model {model!r}: {tried}, so it was taken for a Hub id, and {e}; for a local "
                          "checkpoint give its directory (relative to the current directory)") from None


def model_config(config: OffloadConfig) -> ModelConfig:
    """The model's shape from its config.json alone (a Hub model's is fetched without the weights)."""
    path = config.model / "config.json"
    try:
        raw = json.loads(path.read_text())
        if isinstance(raw, dict) and resolve_impl(config.model_impl, raw) == "transformers":
            return generic_config(raw, None, str(path))  # its sizes: the tensors are not read here
        return ModelConfig.from_dict(raw, str(path))
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; point model: at a checkpoint directory with config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def require_chat(model_dir: Path) -> ChatTemplate:
    """The checkpoint's chat template; a checkpoint without one (or without tokenizer.json) is refused."""
    template = ChatTemplate.from_checkpoint(model_dir)
    if template is None:
        raise ConfigError(f"{model_dir} has no chat template (tokenizer_config.json: chat_template, or "
                          "chat_template.jinja), so it cannot chat; use `offload run --prompt TEXT` for plain "
                          "completion")
    if not (model_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{model_dir} has no tokenizer.json; a chat needs the model's tokenizer")
    return template


def check_new_tokens(cfg: ModelConfig, max_new_tokens: int | None) -> None:
    """A --max-new-tokens that no prompt (of one token or more) fits beside in the context is refused now."""
    if max_new_tokens is not None:
        Context(cfg.max_position_embeddings).check(1, max_new_tokens, "even a one-token prompt",
                                                   knob="--max-new-tokens")


def parse_ids(text: str) -> list[int]:
    """`--prompt-ids 1,450,4996` (commas, spaces or a JSON list) -> [1, 450, 4996]."""
    parts = [p for p in re.split(r"[\s,\[\]]+", text) if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: give token ids as integers separated by commas, e.g. "
                          "--prompt-ids 1,450,4996") from None
    if not ids:
        raise ConfigError("--prompt-ids is empty; give at least one token id, e.g. --prompt-ids 1,450,4996")
    return ids


def plan_for(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
             concurrency: int = 1, context: int | None = None
             ) -> tuple[OffloadConfig, Planner, tuple[Any, ModelConfig] | None, str | None]:
    """The planner a run of `config` uses (around a speculative draft's resident weights, when there is
    one): (the target's config, its planner, (the draft's RunPlan, its ModelConfig) or None, why
    `speculative.tokens: auto` runs plain or None), as `Runner` decides.

    `planner.run_plan()` refuses what cannot fit as a Runner would, reading no weights. `context`: the tokens the
    run needs at most (`Runner(..., context=N)`, as `offload run` passes), else the model's."""
    caps, draft, note = run_capacities(config, device), None, None
    if config.speculative.enabled and config.speculative.tokens is None:
        note = auto_gain(config, cfg, dtype, device, caps).plain_note()
        if note:
            config = config.replace(speculative=SpeculativeConfig())
    if config.speculative.enabled:  # the draft is placed first, resident; the target plans around it
        dconf = draft_config(config)
        dcfg = draft_model_config(config, cfg)
        draft = Planner(dconf, dcfg, dtype, device).run_plan(), dcfg
        caps = reserve_draft(config, caps, draft[0].plan.used("gpu"), draft[0].kv_block_bytes)
    return config, Planner(config, cfg, dtype, device, caps, concurrency=concurrency, context=context), draft, note


def store_to_fill(path: Path) -> StoreState:
    """The state of the store at tiers.disk.path; something else there (a non-empty directory without our files,
    a file) is refused before a conversion is announced, as the conversion would refuse to write into it."""
    state = store_state(path)
    if state is StoreState.FOREIGN:
        what = "a non-empty directory" if path.is_dir() else "a file"
        raise ConfigError(f"tiers.disk.path {path} is {what} that is not an Offload store; point tiers.disk.path "
                          "at an empty or new directory (or an existing store)")
    return state


def compiles_apart(config: OffloadConfig, cfg: ModelConfig) -> bool:
    """Does a command's run of `config` compile its CPU kernels in child processes before its runner starts
    (`before_run`): a CPU device and a model Offload runs natively (a model transformers runs calls none)? (A CUDA
    device is not asked for: `offload plan` plans for one on paper, and a run without it is refused later.)"""
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device).type == "cpu" and cfg.impl == "native"


def plan_as_run(config: OffloadConfig, cfg: ModelConfig) -> None:
    """`offload plan`: plan as a command's run of `config` places its weights, which on a CPU compiles a fresh
    install's kernels in child processes before its runner plans (`before_run`): its `auto` tiers keep no room for
    compiling. Said on stderr where this install has not compiled them yet."""
    apart = compiles_apart(config, cfg)
    compile_apart(apart)
    if apart and stages_needed(bool(packed_kernels(config)), resolve_dtype(config.dtype, cfg.torch_dtype)):
        print("kernels: this install's CPU kernels are not compiled yet: the first run compiles them in child "
              "processes before it starts (a few minutes), and this is the plan it makes then", file=sys.stderr)


def before_run(config: OffloadConfig) -> None:
    """What a command does before its runner starts: a missing store planned and converted (`convert_first`), then,
    on a CPU, the kernels of the run's dtype and packed formats that a fresh install's numba cache lacks compiled
    in child processes (`precompile.compile_kernels`): the run then holds none of the compiler's memory, and its
    plans (the conversion's too) keep no room for it (`memory.compile_apart`). Where a child fails, the run compiles
    what is left in its own process, and its plan keeps that room again."""
    cfg = model_config(config)
    apart = compiles_apart(config, cfg)
    compile_apart(apart)
    convert_first(config)
    if apart and not compile_kernels(resolve_dtype(config.dtype, cfg.torch_dtype), packed_kernels(config),
                                     say=lambda line: print(line, file=sys.stderr)):
        compile_apart(False)


def convert_first(config: OffloadConfig, replace: bool = False) -> None:
    """The first run of a config with a disk tier converts the checkpoint into the store: here, with a
    progress bar on stderr, once the plan is known to fit (a config the runner would refuse converts nothing).
    A complete store is left alone (`replace`: converted again, as `offload convert --force` would: for a store
    the caller owns, such as the demo's cache); an interrupted conversion resumes; other processes wait. A
    complete store of another checkpoint, dtype or weight format is refused now, as the runner would refuse it
    (`convert.open_store`), not after a fresh install's kernels compiled (`before_run`: minutes)."""
    disk = config.tiers.disk if config.tiers is not None else None
    if disk is None:
        return
    complete = store_to_fill(disk.path) is StoreState.COMPLETE and not replace
    if complete and config.hub:  # (its weights come when the runner starts, which checks the store then)
        return
    if config.hub:  # the weights come now, as the runner would fetch them (resumed if interrupted)
        config = config.replace(model=hub.fetch(config.hub))
    ckpt = Checkpoint(config.model, config.model_impl)
    dtype, device = resolve_dtype(config.dtype, ckpt.config.torch_dtype), resolve_device(config.device)
    fmt = WeightFormat.from_config(config.weights, ckpt.config)
    if complete:  # StaleStoreError, as the runner's
        open_tier_store(ckpt, disk, dtype, fmt).close()
        return
    if not launched():  # under torchrun each rank plans its own slice when the run starts
        plan_for(config, ckpt.config, dtype, device)[1].run_plan()  # CapacityError / ConfigError, as the runner's
    if replace:  # under the store's lock: a process reading it is waited for
        print(f"offload: converting {ckpt.path} into the store {disk.path} again", file=sys.stderr)
        convert(ckpt, disk.path, dtype, force=True, capacity=disk.capacity, progress=True, fmt=fmt).close()
        return
    print(f"offload: converting {ckpt.path} into the store {disk.path} (first run only; later runs reuse it)",
          file=sys.stderr)
    open_tier_store(ckpt, disk, dtype, fmt, progress=True).close()
