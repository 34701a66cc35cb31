"""Tokenizers: text <-> token ids. The engine only ever sees ids.

Owns: the ``Tokenizer`` protocol, the byte-level tokenizer of the bundled
model (ids 0..255 are bytes, 256 = BOS, 257 = EOS) and ``load_tokenizer``,
which picks it or a model's own ``tokenizer.json`` (``runtime/hf_tokenizer``).
Incremental decoding yields text pieces only at UTF-8 character boundaries,
so a streamed multi-byte character is never split across pieces.

Must not know: models, frameworks, gRPC.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def stream(self) -> Any:
        """A fresh streaming decoder: ``push(ids) -> str`` and ``flush() -> str``."""
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids of chat messages through the model's chat template (ValueError: none)."""


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"byte"``: the byte tokenizer; otherwise a model directory holding ``tokenizer.json``."""
    if str(spec) == "byte":
        return ByteTokenizer()
    from runtime.hf_tokenizer import HFTokenizer
    return HFTokenizer(spec)


class ByteTokenizer:
    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257
    eos_token_ids = (257,)

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def stream(self) -> "IncrementalDecoder":
        return IncrementalDecoder()

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        raise ValueError("the byte tokenizer has no chat template; send a plain prompt instead")

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class IncrementalDecoder:
    """Turns a stream of byte ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def push(self, ids: list[int]) -> str:
        self._pending.extend(i for i in ids if 0 <= i < 256)
        # Find the longest prefix that ends on a complete UTF-8 character.
        cut = len(self._pending)
        for back in range(1, min(4, len(self._pending)) + 1):
            b = self._pending[-back]
            if b & 0xC0 == 0x80:          # continuation byte: keep looking for the lead
                continue
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            if need > back:
                cut = len(self._pending) - back
            break
        text = bytes(self._pending[:cut]).decode("utf-8", errors="replace")
        del self._pending[:cut]
        return text

    def flush(self) -> str:
        text = bytes(self._pending).decode("utf-8", errors="replace")
        self._pending.clear()
        return text
