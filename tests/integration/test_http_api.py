"""The OpenAI-compatible HTTP API over an in-process stack, driven by the official ``openai`` package.

Greedy output equals Generate's (streaming and not), stop sequences cut the
text, statistics ride in the ``specsplit`` object, the Generate token is
required exactly as over gRPC, and bad requests get 4xx answers naming the
field. Chat is exercised with a stand-in template (``render`` argument); the
real model has none, which ``test_http_api_live.py`` checks end to end.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from orchestrator.client import SpecsplitClient
from orchestrator.http_api import HttpApiServer
from tests.integration.inproc_stack import ADMIN, GEN, TIMEOUT, make_models, start_stack, wait_until

pytestmark = pytest.mark.integration

MODEL = "tiny-bytes"
PROMPT = "def parse(line):\n"


def _render(_tokenizer: str, messages: list[dict]) -> str:
    """A stand-in chat template: the messages' contents, one per line."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(make_models(tmp_path_factory.mktemp("http_models")), tmp_path_factory.mktemp("http_staging"))
    http = HttpApiServer("127.0.0.1", 0, s.address, MODEL, "byte", render=_render).start()
    s.http = http
    yield s
    http.stop()
    s.close()


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http.port}/v1", api_key=GEN, timeout=TIMEOUT,
                         max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(stack):
    with SpecsplitClient(stack.address, timeout=TIMEOUT, token=GEN) as c:
        yield c


def _get(stack, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.http.port}{path}", timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completion_greedy_equals_generate(oai, grpc_client):
    want = grpc_client.generate_text(PROMPT, 40, ignore_eos=True)
    resp = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert resp.choices[0].text == want.text and resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (want.usage["prompt_tokens"], 40)
    spec = resp.model_extra["specsplit"]
    assert spec["drafted"] == want.drafted and spec["accepted"] == want.accepted and spec["rounds"] == want.rounds
    assert spec["weights_version"] == "A" and spec["request_id"] == resp.id
    assert 0 < spec["acceptance_rate"] <= 1 and len(spec["acceptance_per_position"]) == 3


def test_completion_stream_equals_generate(oai, grpc_client):
    want = grpc_client.generate_text(PROMPT, 40, ignore_eos=True)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert len(text_chunks) > 2 and [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert text_chunks[-1].model_extra["specsplit"]["accepted"] == want.accepted


def test_token_prompt_seed_and_sampling(oai, grpc_client):
    ids = [256, *b"import os\n"]
    want = grpc_client.generate_text(ids, 12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    resp = oai.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                                  extra_body={"ignore_eos": True})
    assert resp.choices[0].text == want.text and resp.usage.prompt_tokens == len(ids)


def test_stop_sequences_cut_the_text_and_cancel(stack, oai, grpc_client):
    full = grpc_client.generate_text(PROMPT, 60, ignore_eos=True).text
    stop = full[20:23]
    cut = full[:full.index(stop)]
    resp = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, stop=[stop, "\x00zz"],
                                  extra_body={"ignore_eos": True})
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, stop=stop,
                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut
    wait_until(lambda: grpc_client.status()["target"]["used_slots"] == 0, "the stopped requests' slots to be freed")


def test_chat_goes_through_the_template(oai, grpc_client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f("}]
    want = grpc_client.generate_text(_render("byte", messages), 24, ignore_eos=True)
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == want.text and resp.choices[0].message.role == "assistant"
    assert resp.object == "chat.completion" and resp.model_extra["specsplit"]["rounds"] == want.rounds
    stream = list(oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.text
    assert stream[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, status, needle", [
    ({"n": 2}, 400, "n=2"),
    ({"logprobs": 3}, 400, "logprobs=3"),
    ({"extra_body": {"frequency_penalty": 0.5, "guided_json": {}}}, 400, "frequency_penalty=0.5, guided_json"),
    ({"temperature": 3}, 400, "temperature"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"max_tokens": 100000}, 400, "max_tokens"),             # refused by Generate: INVALID_ARGUMENT -> 400
    ({"model": "gpt-4"}, 404, "'gpt-4' does not exist"),
])
def test_bad_requests_name_the_field(oai, kwargs, status, needle):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        oai.completions.create(**kw)
    assert err.value.status_code == status and needle in err.value.message, err.value.message


def test_bad_chat_messages_and_bodies(stack, oai):
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\]"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http.port}/v1/completions", data=b"{not json",
                                 headers={"Authorization": f"Bearer {GEN}"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=TIMEOUT)
    assert err.value.code == 400 and "not valid JSON" in json.loads(err.value.read())["error"]["message"]


def test_the_generate_token_is_required(stack):
    base = f"http://127.0.0.1:{stack.http.port}/v1"
    wrong = openai.OpenAI(base_url=base, api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    for headers in ({}, {"Authorization": "Basic abc"}):          # no token; not a bearer token
        req = urllib.request.Request(f"{base}/completions", data=body, headers=headers, method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=TIMEOUT)
        assert err.value.code == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
    admin = openai.OpenAI(base_url=base, api_key=ADMIN, timeout=TIMEOUT, max_retries=0)
    assert admin.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_models_and_health(stack, oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["specsplit"]["weights_version"] == "A"
    assert _get(stack, "/health") == (200, {"status": "SERVING"})


def test_health_is_503_when_the_orchestrator_is_gone(tmp_path):
    http = HttpApiServer("127.0.0.1", 0, "127.0.0.1:1", MODEL, "byte").start()   # nothing listens on port 1
    try:
        status, body = _get(type("S", (), {"http": http}), "/health")
        assert status == 503 and body["status"].startswith("UNAVAILABLE")
    finally:
        http.stop()
