"""Text <-> token ids through a `tokenizer.json` (the `tokenizers` library). Knows no model."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok, self.ids, self.emitted = tok, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete or invalid tail), at the end of a sequence."""
        text = self.tok.decode(self.ids)
        delta, self.emitted = text[len(self.emitted):] if text.startswith(self.emitted) else "", text
        return delta
