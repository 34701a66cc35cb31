"""A model's own tokenizer.json: ids, BOS/EOS, chat template and streaming vs transformers."""

from __future__ import annotations

import json

import pytest
import transformers
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from runtime.hf_tokenizer import HFTokenizer, TokenizerError
from runtime.tokenizer import ByteTokenizer, load_tokenizer

CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog.", "Grüße aus Köln — naïve café ☕",
          "数学 and 日本語 text, emoji 🙂🚀 and ends.", "def f(x):\n    return x * 2  # code"] * 20
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS]{{ m['content'] }}[/SYS]"
            "{% else %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXTS = ["Hello world!", "Grüße — naïve café ☕ 🙂🚀", "数学 日本語", "  leading and trailing  ", "a\n\tb", ""]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A byte-level BPE tokenizer saved the way transformers saves one, plus generation_config.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<eot>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    d = tmp_path_factory.mktemp("tok")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    return d


def test_ids_bos_eos_match_transformers(model_dir):
    ours, ref = HFTokenizer(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids, text
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.encode("x")[0] == 0 == ours.bos_token_id
    assert ours.eos_token_ids == (1, 2) and ours.eos_token_id == 1        # generation_config.json's list


def test_chat_template_renders_as_transformers(model_dir):
    ours, ref = HFTokenizer(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Grüße 🙂 "},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "数学?"}]
    assert ours.render_chat(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours.encode_chat(msgs) == list(want)


def test_no_chat_template_is_a_clear_error(model_dir, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    with pytest.raises(TokenizerError, match="no chat template"):
        HFTokenizer(tmp_path).encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        ByteTokenizer().encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab ü—☕🙂数\n")), max_size=30),
       chunk=st.integers(min_value=1, max_value=4))
def test_streaming_never_splits_a_character_and_matches_whole(model_dir, text, chunk):
    tok = HFTokenizer(model_dir)
    ids = tok.encode(text, add_special_tokens=False) + [1]          # ends with a special token (skipped)
    dec = tok.stream()
    pieces = [dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)


def test_load_tokenizer_picks_byte_or_model_dir(model_dir):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(model_dir), HFTokenizer)
