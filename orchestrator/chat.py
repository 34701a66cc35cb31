"""Chat messages -> one prompt string: the single place a chat template is applied.

Owns: ``render_chat`` (called by the HTTP API's ``/v1/chat/completions``) and
the ``NoChatTemplate`` error it raises for a tokenizer without a template.
Today the only tokenizer is the byte tokenizer of the bundled model, which has
no chat template, so every call raises; when tokenizers carry a chat template
(``tokenizer.json`` + ``tokenizer_config.json``, rendered with jinja2 as
transformers does), it is applied here and nowhere else.

Must not know: HTTP, gRPC, the orchestrator's internals.
"""

from __future__ import annotations

from typing import Any, Sequence


class NoChatTemplate(ValueError):
    """The served model has no chat template: chat requests cannot be turned into a prompt."""


def render_chat(tokenizer: str, messages: Sequence[dict[str, Any]]) -> str:
    """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...], already validated)
    under the chat template of ``tokenizer`` (the orchestrator's ``tokenizer`` setting)."""
    raise NoChatTemplate(f"the served model has no chat template (tokenizer {tokenizer!r}): "
                         "/v1/chat/completions needs one; send a plain prompt to /v1/completions instead")
