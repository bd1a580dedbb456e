"""Checkpoints named by their Hugging Face Hub id (`meta-llama/Llama-3.1-70B-Instruct`, `org/name@revision`).

    if is_hub_id(value): path = fetch(value, weights=False)   # config, tokenizer, generation config
    path = fetch(value)                                        # ... and the safetensors shards

Files come through `huggingface_hub` into its cache, so everything it honours is honoured:
HF_HOME / HF_HUB_CACHE (where), HF_TOKEN or a saved login (gated and private repositories),
HF_HUB_OFFLINE (the cache only), HF_ENDPOINT (a mirror), and interrupted downloads resume.
Only what a run needs is downloaded: config and tokenizer files, generation_config.json, the
safetensors weights and their index. Pickled weights (*.bin, *.pt, *.pth) are never fetched
nor loaded. `offload plan` needs config.json alone, so the weights are fetched only when a
runner starts. This module knows file names; it reads no tensors.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from offload.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

#: what a run reads besides the weights
METADATA = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "model.safetensors.index.json"]
WEIGHTS = ["*.safetensors"]
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def is_hub_id(value: str, base_dir: Path | None = None) -> bool:
    """`org/name` or `org/name@revision` that is not an existing path (a local directory always wins)."""
    if value.startswith((".", "/", "~")) or not _ID.match(value):
        return False
    return not (Path(base_dir or ".") / value).exists()


def split_id(value: str) -> tuple[str, str | None]:
    m = _ID.match(value)
    if m is None:
        raise ConfigError(f"model: {value!r} is neither a directory nor a Hub id like org/name or org/name@revision")
    return m.group("repo"), m.group("revision")


def fetch(value: str, weights: bool = True, key: str = "model") -> Path:
    """The local snapshot directory of a Hub checkpoint, downloading what is missing (see the module doc);
    errors name the config `key` it came from."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download  # here: a third of a second off every start from a directory

    repo, revision = split_id(value)
    where = f"{key}: {value}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=METADATA + (WEIGHTS if weights else []),
                                      ignore_patterns=["*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt"]))
    except hub_errors.GatedRepoError:
        raise ConfigError(f"{where}: the repository is gated; accept its license on the Hub with your account, then "
                          "set HF_TOKEN (or run `hf auth login`) and try again") from None
    except hub_errors.RevisionNotFoundError:
        raise ConfigError(f"{where}: revision {revision!r} does not exist in {repo}; use a branch, tag or commit "
                          "of the repository (or drop @revision for main)") from None
    except hub_errors.RepositoryNotFoundError:
        raise ConfigError(f"{where}: no such repository on the Hub (or it is private); check the id, or set "
                          "HF_TOKEN to a token that can read it") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled) as e:
        if offline:
            raise ConfigError(f"{where}: HF_HUB_OFFLINE is set and the Hub cache ({_cache()}) does not hold this "
                              "checkpoint; download it once online (unset HF_HUB_OFFLINE) or give a local "
                              "directory") from None
        raise ConfigError(f"{where}: the Hub could not be reached and the cache ({_cache()}) does not hold it "
                          f"({type(e).__name__}); check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use "
                          "the cache only") from None
    except hub_errors.HfHubHTTPError as e:
        raise ConfigError(f"{where}: the Hub refused the download ({e.response.status_code}); check HF_TOKEN and "
                          "HF_ENDPOINT") from None
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{where}: the repository has no config.json at its top level; it is not a "
                              "Transformers checkpoint Offload can run")
    if weights and not any(path.glob("*.safetensors")):
        if offline:
            raise ConfigError(f"{where}: HF_HUB_OFFLINE is set and the Hub cache ({_cache()}) holds this "
                              "checkpoint's config but not its weights; download them once online")
        raise CheckpointError(f"{where}: the repository has no *.safetensors weights (Offload never loads pickled "
                              "*.bin/*.pt files); use a safetensors revision of the model")
    log.info("%s: %s", value, path)
    return path


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
