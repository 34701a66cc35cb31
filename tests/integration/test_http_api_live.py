"""End to end: ``specsplit up``'s stack (bundled model, three processes) with the HTTP API on,
driven by the official ``openai`` package; the discovery lines report real ports."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from orchestrator.client import SpecsplitClient

pytestmark = pytest.mark.integration

TIMEOUT = 60.0
PROMPT = "def parse(line):\n"


@pytest.fixture(scope="module")
def oai(live_stack):
    return openai.OpenAI(base_url=live_stack.addresses()["http"], api_key="any", timeout=TIMEOUT, max_retries=0)


def test_completions_stream_and_not_equal_generate(live_stack, oai):
    with SpecsplitClient(live_stack.orchestrator_address, timeout=TIMEOUT) as c:
        want = c.generate_text(PROMPT, 48)
    resp = oai.completions.create(model="specsplit", prompt=PROMPT, max_tokens=48, temperature=0)
    assert resp.choices[0].text == want.text and resp.choices[0].finish_reason == want.finish_reason
    assert resp.model_extra["specsplit"]["accepted"] == want.accepted > 0
    stream = oai.completions.create(model="specsplit", prompt=PROMPT, max_tokens=48, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == want.text


def test_chat_says_the_bundled_model_has_no_chat_template(oai):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        oai.chat.completions.create(model="specsplit", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        list(oai.chat.completions.create(model="specsplit", messages=[{"role": "user", "content": "hi"}],
                                         stream=True))


def test_listening_lines_report_the_real_metrics_ports(live_stack):
    ports = live_stack.addresses()["metrics_ports"]
    assert set(ports) == {"target", "draft", "orchestrator"}
    for name, port in ports.items():
        assert isinstance(port, int) and port > 0, (name, port)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT).read().decode()
        assert "specsplit_" in text, name
