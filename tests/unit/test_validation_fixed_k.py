"""orchestrator/validation.py: GenerateRequest.fixed_k reaches the round loop's request."""

from __future__ import annotations

from orchestrator.config import OrchestratorConfig
from orchestrator.validation import ModelFacts, validate
from runtime.tokenizer import ByteTokenizer
from specsplit.v1 import orchestrator_pb2 as opb

FACTS = ModelFacts(vocab_size=258, max_len=256, eos_token_id=257, weights_version="v0", slots=4, draft_max_k=3)


def test_fixed_k_is_carried_and_off_by_default():
    cfg = OrchestratorConfig(draft_address="127.0.0.1:1")
    for asked in (False, True):
        req = opb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, k=2, fixed_k=asked)
        got = validate(req, cfg, FACTS, True, ByteTokenizer())
        assert got.k == 2 and got.fixed_k is asked
    assert validate(opb.GenerateRequest(prompt_token_ids=[1], max_tokens=4), cfg, FACTS, True,
                    ByteTokenizer()).fixed_k is False
