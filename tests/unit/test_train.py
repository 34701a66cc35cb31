"""Unit tests for training/torch_train.py and training/corpus.py (CPU, seconds).

- the unrolled MTP loss reproduces, pass for pass, what the draft engine computes at
  inference (catch-up over true pairs in a KV cache, then substeps on its own hidden);
- a few steps of training reduce the loss; unroll 1 and 3 both run and train only mtp.*;
- ``specsplit train`` end to end on a tiny config writes files that load with
  check_target / check_draft;
- the corpus split is deterministic and the held-out prompts have the promised shape.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from runtime.backends.torch_ops import TorchOps  # noqa: E402
from training.torch_train import (add_train_args, make_params, main_train, target_loss,  # noqa: E402
                                          tiny_config)
from training.torch_unroll import (mtp_unrolled_logits, mtp_unrolled_loss, target_hidden,  # noqa: E402
                                           unroll_layout)
from training.corpus import BatchSampler, heldout_prompts, is_heldout, list_sources, load_corpus  # noqa: E402
from runtime.model import Rope, build_attn_meta, lm_head, mtp_forward, mtp_tensor_shapes, target_tensor_shapes  # noqa: E402
from runtime.weights import check_draft, check_target, read_arrays  # noqa: E402

CFG = tiny_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64)


@pytest.fixture(scope="module")
def ops():
    return TorchOps("cpu", "float32")


def _params(seed_t=1, seed_m=2):
    target = make_params(CFG, target_tensor_shapes(CFG), seed_t, "cpu", CFG.num_hidden_layers)
    mtp = make_params(CFG, mtp_tensor_shapes(CFG), seed_m, "cpu", 1)
    with torch.no_grad():  # a non-trivial head: larger weights so passes differ visibly
        for name, p in mtp.items():
            if p.ndim == 2:
                p.mul_(10.0)
    return target, mtp


def _tokens(b, t, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size=(b, t + 1))).to(torch.int64)


def test_unroll_layout_mask():
    mask, pos = unroll_layout(3, 4, "cpu")
    m = mask[0].numpy()
    assert m.shape == (12, 12)
    assert pos[0].tolist() == [0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5]
    # pass 1: plain causal over true pairs
    assert (m[:4, :4] == np.tril(np.ones((4, 4), bool))).all() and not m[:4, 4:].any()
    # pass 3 at anchor 1 sees true pairs 0..1, then pass 2 and 3 at anchor 1 only
    assert np.flatnonzero(m[8 + 1]).tolist() == [0, 1, 4 + 1, 8 + 1]


def test_unrolled_training_matches_inference(ops):
    """Pass s at anchor j == catch-up over pairs 0..j in a KV cache, then s-1 substeps
    on the MTP's own output hidden with tokens t_{j+2}..t_{j+s} (DraftEngine's math)."""
    target, mtp = _params()
    p = {**{n: t.detach() for n, t in target.items()}, **{n: t.detach() for n, t in mtp.items()}}
    n, t = 3, 10
    tokens = _tokens(1, t)
    rope = Rope(ops, CFG, 64)
    with torch.no_grad():
        hidden, _ = target_hidden(ops, p, CFG, rope, tokens[:, :-1])
        train = mtp_unrolled_logits(ops, p, CFG, rope, tokens, hidden, n)                # [1, N, M, V]
        max_len = 32
        for j in range(t - n):
            kc = ops.zeros((2 * max_len, CFG.num_key_value_heads, CFG.head_dim))
            vc = ops.zeros((2 * max_len, CFG.num_key_value_heads, CFG.head_dim))
            pos = torch.arange(j + 1)[None]
            meta = build_attn_meta(ops, rope, torch.zeros_like(pos), pos, torch.zeros(1, dtype=torch.int64),
                                   max_len, max_len, CFG.num_attention_heads // CFG.num_key_value_heads)
            g = mtp_forward(ops, p, CFG, hidden[:, :j + 1], tokens[:, 1:j + 2], meta, (kc, vc))[:, -1:]
            got = [lm_head(ops, p, CFG, g)[0, 0]]
            for s in range(2, n + 1):
                pos = torch.tensor([[j + s - 1]])
                meta = build_attn_meta(ops, rope, torch.zeros_like(pos), pos, torch.zeros(1, dtype=torch.int64),
                                       max_len, max_len, CFG.num_attention_heads // CFG.num_key_value_heads)
                g = mtp_forward(ops, p, CFG, g, tokens[:, j + s:j + s + 1], meta, (kc, vc))
                got.append(lm_head(ops, p, CFG, g)[0, 0])
            for s in range(n):
                torch.testing.assert_close(train[0, s, j], got[s], atol=2e-4, rtol=1e-4)
    # the passes really differ (otherwise the comparison above proves little)
    assert (train[0, 0] - train[0, 2]).abs().max() > 1e-2


@pytest.mark.parametrize("unroll", [1, 3])
def test_mtp_loss_trains_only_mtp(ops, unroll):
    target, mtp = _params()
    frozen = {n: t.detach() for n, t in target.items()}
    rope = Rope(ops, CFG, 64)
    tokens = _tokens(2, 16)
    hidden, tlogits = target_hidden(ops, frozen, CFG, rope, tokens[:, :-1])
    opt = torch.optim.AdamW(list(mtp.values()), lr=3e-3)
    losses = []
    for _ in range(8):
        out = mtp_unrolled_loss(ops, {**frozen, **mtp}, CFG, rope, tokens, hidden, tlogits, unroll, distill=0.5)
        assert out.hard.shape == (unroll,) and out.agree.shape == (unroll,)
        opt.zero_grad()
        out.loss.backward()
        assert all(p.grad is not None for p in mtp.values())
        assert all(t.grad is None for t in target.values())
        opt.step()
        losses.append(float(out.loss))
    assert losses[-1] < losses[0]


def test_target_steps_reduce_loss(ops):
    target, _ = _params()
    rope = Rope(ops, CFG, 64)
    stream = np.tile(np.frombuffer(b"def f(x):\n    return x + 1\n\n", np.uint8).astype(np.uint16), 50)
    sampler = BatchSampler(stream, 4, 32, 0)
    opt = torch.optim.AdamW(list(target.values()), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = target_loss(ops, target, CFG, rope, torch.from_numpy(sampler.next()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5


def _fake_stdlib(root):
    for i in range(40):
        sub = root / ("pkg" if i % 3 else "") / f"mod{i}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def func_{i}_{k}(a, b={k}):\n    '''Add things.'''\n    return a + b * {i}\n\n"
                       for k in range(12))
        sub.write_text(f"import os\nimport sys\n\n{body}")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "other.py").write_text("x = 1\n")


def test_corpus_split_and_prompts(tmp_path):
    _fake_stdlib(tmp_path)
    files = list_sources(tmp_path)
    assert len(files) == 40 and not any("site-packages" in f for f in files)
    corpus = load_corpus(tmp_path, heldout_frac=0.3)
    assert set(corpus.heldout_files) == {f for f in files if is_heldout(f, 0.3)}
    assert corpus.heldout_files and corpus.train_files
    assert int(corpus.train[0]) == 256 and int(corpus.train[-1]) == 257
    prompts = heldout_prompts(corpus, n=6, seed=0)
    assert prompts == heldout_prompts(load_corpus(tmp_path, heldout_frac=0.3), n=6, seed=0)
    assert len(prompts) == 6 and all(64 <= len(p) <= 200 and p.endswith("\n") and p.isascii() for p in prompts)
    assert is_heldout("json/decoder.py") == is_heldout("json/decoder.py")


def test_train_cli_end_to_end(tmp_path):
    corpus = tmp_path / "corpus"
    _fake_stdlib(corpus)
    out = tmp_path / "model"
    argv = ["--out", str(out), "--corpus", str(corpus), "--heldout-frac", "0.3", "--steps", "30", "--batch", "4",
            "--seq-len", "32", "--mtp-steps", "6", "--mtp-unroll", "3", "--naive-head", "--hidden-size", "32",
            "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--warmup", "3",
            "--prompts", "4", "--no-progress", "--seed", "0"]
    assert main_train(argv) == 0
    log = json.loads((out / "train_log.json").read_text())
    hist = log["target"]["history"]
    assert hist[-1]["loss0"] < hist[0]["loss0"] - 1.0
    assert log["mtp"]["unrolls"] == [3, 1]
    ck = check_target(out)
    assert ck.cfg.bos_token_id == 256 and ck.cfg.eos_token_id == 257 and ck.cfg.hidden_size == 32
    for name in ("mtp.safetensors", "mtp_naive.safetensors"):
        arrays = read_arrays(check_draft(ck, out / name))
        assert set(mtp_tensor_shapes(ck.cfg)) <= set(arrays)
    assert len(json.loads((out / "heldout_prompts.json").read_text())) == 4
    # --steps 0 reuses the saved target and trains only the head
    import argparse
    args = add_train_args(argparse.ArgumentParser()).parse_args(
        argv[:6] + ["--steps", "0", "--batch", "2", "--seq-len", "16", "--mtp-steps", "2", "--mtp-unroll", "2",
                    "--prompts", "0", "--no-progress"])
    from training.torch_train import run_train
    assert run_train(args)["mtp"]["unrolls"] == [2]
