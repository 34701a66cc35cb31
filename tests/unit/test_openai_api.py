"""OpenAI request validation and stop sequences (``orchestrator.openai_api``), without servers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.chat import NoChatTemplate, render_chat
from orchestrator.openai_api import ApiError, StopMatcher, parse_chat, parse_completion
from core.config import ConfigError, SecurityConfig
from orchestrator.config import OrchestratorConfig

M = "m"


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut before the stop sequence completed first (of those ending together, the longest)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[:end - max(map(len, done))], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab\n", max_size=40), stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4),
                                                                  min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_matcher_equals_cutting_the_whole_text(text, stops, cuts):
    """Regression: the cut once depended on chunk boundaries (stops ['a', '\\naa'], text '\\naa')."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    m = StopMatcher(stops)
    out = "".join(m.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    out += m.flush()
    assert (out, m.stopped) == reference_cut(text, stops)


def test_completion_fields_map_and_defaults():
    p = parse_completion({"model": M, "prompt": ["hi"], "stop": "x", "seed": 3, "top_p": 0.5, "user": "u",
                          "logprobs": None, "echo": False, "stream": True, "stream_options": {"include_usage": True},
                          "k": 2, "top_k": 5, "sampling_mode": "coupled"}, M)
    assert (p.prompt, p.max_tokens, p.temperature, p.stop, p.include_usage) == ("hi", 16, 1.0, ("x",), True)
    assert p.generate_kwargs() == dict(max_tokens=16, temperature=1.0, top_p=0.5, seed=3, top_k=5, k=2,
                                       ignore_eos=False, sampling_mode="coupled")
    assert parse_completion({"model": M, "prompt": "x"}, M).sampling_mode is None    # the server's default
    assert parse_completion({"model": M, "prompt": [[1, 2]]}, M).prompt == (1, 2)


@pytest.mark.parametrize("body, status, needle", [
    ({"prompt": "x"}, 400, "model is required"),
    ({"model": "other", "prompt": "x"}, 404, "'other' does not exist"),
    ({"model": M}, 400, "prompt must be"),
    ({"model": M, "prompt": ["a", "b"]}, 400, "batches of several prompts"),
    ({"model": M, "prompt": "x", "max_tokens": 0}, 400, "max_tokens=0"),
    ({"model": M, "prompt": "x", "max_tokens": True}, 400, "max_tokens=True"),
    ({"model": M, "prompt": "x", "top_p": 0}, 400, "top_p=0"),
    ({"model": M, "prompt": "x", "sampling_mode": "gumbel"}, 400, "sampling_mode='gumbel'"),
    ({"model": M, "prompt": "x", "stop": [""]}, 400, "stop="),
    ({"model": M, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "only allowed with stream"),
    ({"model": M, "prompt": "x", "best_of": 2, "suffix": "s"}, 400, "best_of=2, suffix='s'"),
    ({"model": M, "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools="),
    ([1, 2], 400, "JSON object"),
])
def test_bad_completion_bodies_name_the_field(body, status, needle):
    with pytest.raises(ApiError) as err:
        parse_completion(body, M)
    assert err.value.status == status and needle in err.value.message, err.value.message
    assert err.value.body()["error"]["message"] == err.value.message


def test_chat_validates_before_the_template_and_the_byte_model_has_none():
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat({"model": M, "messages": msgs, "max_completion_tokens": 5}, M,
                      lambda m: "P:" + m[0]["content"]).prompt == "P:hi"
    with pytest.raises(ApiError, match="not both"):
        parse_chat({"model": M, "messages": msgs, "max_tokens": 1, "max_completion_tokens": 2}, M, lambda m: "")
    with pytest.raises(ApiError, match="messages\\[0\\]"):
        parse_chat({"model": M, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, M, lambda m: "")
    with pytest.raises(NoChatTemplate, match="no chat template"):
        parse_chat({"model": M, "messages": msgs}, M, lambda m: render_chat("byte", m))


def test_grpc_codes_map_to_http_statuses():
    assert ApiError.from_grpc("UNAUTHENTICATED", "no").status == 401
    assert ApiError.from_grpc("RESOURCE_EXHAUSTED", "full").status == 429
    assert ApiError.from_grpc("INTERNAL", "x").status == 500


def test_http_port_is_refused_beside_tls():
    with pytest.raises(ConfigError, match="http_port"):
        OrchestratorConfig(draft_address=None, http_port=0, security=SecurityConfig(tls_cert="c.pem", tls_key="k.pem"))
