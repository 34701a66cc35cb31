"""A checkpoint + tokenizer saved by transformers, served through the gRPC services.

The target (Paddle, in-process) and draft load a directory written by
``save_pretrained``; the orchestrator uses its tokenizer.json. Text, token-id
and chat prompts give transformers' greedy tokens (speculative k=3 and
target-only); stop strings cut the text; a prompt longer than the model's
max_position_embeddings is INVALID_ARGUMENT naming both numbers.
"""

from __future__ import annotations

import grpc
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient, SpecsplitError
from orchestrator.server import create_server
from runtime.config import CacheConfig, GraphConfig, OrchestratorConfig, RuntimeConfig, ServerConfig, SpecConfig, \
    WorkerConfig
from target_service.server import start as start_target
from tests import hf_models

pytestmark = pytest.mark.integration

TIMEOUT = 30.0
VOCAB = 320
MAX_POS = 128
MAX_NEW = 40
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "Grüße aus Köln, naïve café ☕ 🙂", "hello world"] * 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_serving")
    model = hf_models.build("llama", d, seed=3, vocab_size=VOCAB, max_position_embeddings=MAX_POS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=VOCAB - 4, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(d)
    return d, model, transformers.AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def client(model_dir):
    d = model_dir[0]

    def wcfg(role):
        return WorkerConfig(role=role, target_path=str(d), weights_version="v1", runtime=RuntimeConfig(backend="paddle"),
                            spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=4, max_len=256),
                            graphs=GraphConfig(batch_buckets=(1, 4)), server=ServerConfig(port=0, max_workers=8))
    target, draft = start_target(wcfg("target")), start_draft(wcfg("draft"))
    server, port = create_server(OrchestratorConfig(
        draft_address=f"127.0.0.1:{draft.port}", target_address=f"127.0.0.1:{target.port}", tokenizer=str(d),
        worker_timeout_s=TIMEOUT, server=ServerConfig(port=0)))
    with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as c:
        yield c
    server.stop(0).wait(5)
    target.stop(grace=None)
    draft.stop(grace=None)


def _hf_greedy(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return list(out[0, len(ids):])


@pytest.mark.parametrize("k", [0, 3])
def test_text_and_token_id_prompts_give_transformers_tokens(model_dir, client, k):
    _, model, hf_tok = model_dir
    text = "the quick brown fox"
    ids = hf_tok(text).input_ids
    want = [int(t) for t in _hf_greedy(model, ids)]
    by_text = client.generate_text(text, MAX_NEW, k=k, ignore_eos=True)
    by_ids = client.generate_text(ids, MAX_NEW, k=k, ignore_eos=True)
    assert list(by_text.tokens) == want == list(by_ids.tokens)
    assert by_text.usage["prompt_tokens"] == len(ids)
    assert by_text.text == hf_tok.decode(want, skip_special_tokens=True)


def test_chat_messages_use_the_model_template(model_dir, client):
    _, model, hf_tok = model_dir
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Grüße 🙂"}]
    ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    res = client.generate_text(msgs, MAX_NEW, ignore_eos=True)
    assert res.usage["prompt_tokens"] == len(ids)
    assert list(res.tokens) == [int(t) for t in _hf_greedy(model, ids)]


def test_stop_string_cuts_the_text(model_dir, client):
    full = client.generate_text("hello world", MAX_NEW, ignore_eos=True)
    visible = full.text.strip()
    assert len(visible) > 6, "the random model must print some text for this test"
    stop = visible[3:6]
    res = client.generate_text("hello world", MAX_NEW, ignore_eos=True, stop=[stop])
    assert res.finish_reason == "stop"
    assert res.text == full.text[:full.text.find(stop)]
    assert list(res.tokens) == list(full.tokens[:len(res.tokens)]) and len(res.tokens) < len(full.tokens)


def test_prompt_longer_than_max_position_embeddings_is_refused(client):
    with pytest.raises(SpecsplitError) as err:
        client.generate_text([0] + [5] * MAX_POS, 4)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_POS + 1) in err.value.details and f"max_position_embeddings={MAX_POS}" in err.value.details


def test_up_no_draft_serves_a_transformers_directory(model_dir, tmp_path):
    """`specsplit up --model DIR --no-draft` on a save_pretrained directory (without mtp.safetensors):
    the model's own tokenizer, transformers' greedy tokens."""
    import shutil
    import subprocess
    import sys

    from tests.integration.hardening_utils import REPO, child_env, read_json_line

    d, model, hf_tok = model_dir
    plain = tmp_path / "model"
    shutil.copytree(d, plain, ignore=shutil.ignore_patterns("mtp.safetensors"))
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "WARNING", "up", "--model", str(plain),
                             "--no-draft", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=child_env(), cwd=REPO)
    try:
        addresses = read_json_line(proc.stdout, 180)
        with SpecsplitClient(addresses["orchestrator"], timeout=TIMEOUT) as c:
            res = c.generate_text("hello world", MAX_NEW, ignore_eos=True)
        assert list(res.tokens) == [int(t) for t in _hf_greedy(model, hf_tok("hello world").input_ids)]
    finally:
        proc.terminate()
        proc.wait(60)


def test_up_serves_a_train_mtp_head_speculatively(model_dir, tmp_path):
    """`specsplit train-mtp` on the transformers directory (its corpus tokenized by the model's own
    tokenizer.json), then `specsplit up --model DIR` with the head it wrote: speculative output equals
    target-only and transformers' greedy tokens, and drafts are proposed."""
    import shutil
    import subprocess
    import sys

    from tests.integration.hardening_utils import REPO, child_env, read_json_line

    d, model, hf_tok = model_dir
    trained = tmp_path / "model"
    shutil.copytree(d, trained, ignore=shutil.ignore_patterns("mtp.safetensors"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 4))
    run = subprocess.run([sys.executable, "-m", "specsplit", "train-mtp", "--target", str(trained), "--corpus",
                          str(corpus), "--steps", "3", "--batch", "2", "--seq-len", "32", "--unroll", "2",
                          "--eval-prompts", "2", "--eval-prompt-len", "8", "--eval-tokens", "8", "--cpu-threads", "1"],
                         capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (trained / "mtp.safetensors").is_file() and "per position" in run.stdout
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "WARNING", "up", "--model",
                             str(trained), "--backend", "torch", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=child_env(), cwd=REPO)
    try:
        addresses = read_json_line(proc.stdout, 180)
        ids = hf_tok("the quick brown fox").input_ids
        with SpecsplitClient(addresses["orchestrator"], timeout=TIMEOUT) as c:
            spec = c.generate_text(ids, MAX_NEW, k=3, ignore_eos=True)
            plain = c.generate_text(ids, MAX_NEW, k=0, ignore_eos=True)
        assert list(spec.tokens) == list(plain.tokens) == [int(t) for t in _hf_greedy(model, ids)]
        assert spec.drafted > 0 and plain.drafted == 0          # the head drafted; target-only did not
    finally:
        proc.terminate()
        proc.wait(60)
