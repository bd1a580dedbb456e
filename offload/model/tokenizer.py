"""Text <-> token ids through a `tokenizer.json` (the `tokenizers` library). Knows no model."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from offload.errors import CheckpointError


class TextTokenizer:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # the tokenizers library raises plain Exceptions for bad files
            raise CheckpointError(f"{self.path}: cannot load tokenizer ({e}); re-download or remove it") from None

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> TextTokenizer | None:
        path = Path(directory) / "tokenizer.json"
        return cls(path) if path.is_file() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token's string and id (with added tokens): two tokenizers agree when these are equal."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens=False` for text that already carries them (a rendered chat template)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a growing list of ids into text deltas in O(1) per token (`tokenizers`' DecodeStream), holding
    back incomplete UTF-8 sequences until they complete."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok, self.ids = tok, []
        self._pieces: list[str] = []
        self._stream = DecodeStream(skip_special_tokens=True)

    @property
    def emitted(self) -> str:
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        delta = self._stream.step(self.tok._tok, token_id) or ""
        if delta:
            self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete or invalid tail), at the end of a sequence (O(n), once)."""
        text, emitted = self.tok.decode(self.ids), self.emitted
        delta = text[len(emitted):] if text.startswith(emitted) else ""
        if delta:
            self._pieces.append(delta)
        return delta
