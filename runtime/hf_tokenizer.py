"""A model's own tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

Owns: reading a Hugging Face model directory's tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``generation_config.json``, ``chat_template.jinja``), BOS / EOS ids as the
model files give them, encoding as transformers' ``tokenizer(text)`` does,
streamed detokenization (``stream()``), and chat templates rendered with
jinja2 the way transformers' ``apply_chat_template`` renders them.

Must not know: models, frameworks, gRPC.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer


class TokenizerError(ValueError):
    """The tokenizer files are unusable, or a request cannot be tokenized; the message says why."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: unreadable: {exc}") from exc
    return out if isinstance(out, dict) else {}


def _token_text(v: Any) -> str | None:
    """``"<s>"`` or an AddedToken dict ``{"content": "<s>", ...}`` -> its text."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, list) else [v]))


class HFTokenizer:
    """The tokenizer of a model directory; ids match transformers' fast tokenizer."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{d}: no tokenizer.json (only fast, tokenizer.json tokenizers are supported)")
        try:
            self._tok = _RustTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust library raises plain Exception
            raise TokenizerError(f"{path}: unreadable: {exc}") from exc
        cfg = _read_json(d / "tokenizer_config.json")
        special = _read_json(d / "special_tokens_map.json")
        gen = _read_json(d / "generation_config.json")
        model = _read_json(d / "config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(cfg.get(name, special.get(name)))
            if text is not None:
                self.special_tokens[name] = text
        # NOTE: ids as generation uses them: generation_config.json first (it may list
        # several EOS ids, e.g. Llama-3 instruct), then config.json, then the token texts.
        self.eos_token_ids = (_ids(gen.get("eos_token_id")) or _ids(model.get("eos_token_id"))
                              or self._id_of(self.special_tokens.get("eos_token")))
        bos = _ids(gen.get("bos_token_id")) or _ids(model.get("bos_token_id")) or \
            self._id_of(self.special_tokens.get("bos_token"))
        self.bos_token_id: int | None = bos[0] if bos else None
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        template = cfg.get("chat_template")
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):          # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._special_ids = {self._tok.token_to_id(t.content) for t in self._added_special()}

    def _added_special(self) -> list[Any]:
        return [t for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def _id_of(self, text: str | None) -> tuple[int, ...]:
        if text is None:
            return ()
        i = self._tok.token_to_id(text)
        return () if i is None else (i,)

    # --- text <-> ids ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As transformers' ``tokenizer(text).input_ids`` (BOS where the tokenizer adds one)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_spaces else text

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)

    # --- chat -------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` ([{role, content}]) through the model's chat template."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json chat_template or "
                                 "chat_template.jinja); send a plain prompt instead")
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """As transformers' ``apply_chat_template(messages, add_generation_prompt=True)``: the
        rendered text tokenized without adding special tokens (the template writes them)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class StreamDecoder:
    """Streamed detokenization: each ``push`` returns the new text, never a partial character.

    Decodes a short window of ids before the unread ones and the window with them,
    and emits the difference (the tokens-to-text step of TGI / vLLM): decoders that
    strip a leading space or merge byte pieces see the same context as a decode of
    the whole sequence. A window ending in U+FFFD (an incomplete UTF-8 sequence from
    byte-fallback or byte-level pieces) is held back until the character completes.
    """

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0            # window start
        self._read = 0              # ids before this are emitted

    def push(self, ids: list[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd") and text.startswith(prefix_text):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (output ended inside a character)."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):] if text.startswith(prefix_text) else ""


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (used when clean_up_tokenization_spaces is set)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


_COMPILED: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (sandboxed, trim/lstrip blocks,
    loop controls, ``tojson`` without key sorting, ``raise_exception``, ``strftime_now``)."""
    if source not in _COMPILED:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]
