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


class StopStrings:
    """Stops streamed text at the first of some stop strings (the stop string itself is not emitted).

    Holds back the last ``len(longest stop) - 1`` characters, which might begin a stop
    string that the next piece completes, so no emitted text ever has to be taken back.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """New text -> the part that is safe to emit now ('' once stopped)."""
        if self.stopped:
            return ""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[:min(hits)], ""
            return out
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
