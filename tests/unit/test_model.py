"""The shared model definition against a float64 numpy reference, on both backends."""

import numpy as np
import pytest

from runtime.backends import make_ops
from runtime.batch_layout import Row, layout_rows
from runtime.config import ModelConfig, RuntimeConfig
from runtime.kv_cache import KVCache
from runtime.model import (Rope, build_attn_meta, fuse_projections, head_argmax, init_params, lm_head, mtp_forward,
                           mtp_tensor_shapes, target_forward, target_tensor_shapes)

CFG = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d // 2) / (d // 2))
    ang = np.outer(pos, inv)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def _layer(p, pre, x, cfg):
    t = x.shape[0]
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hn = _rms(x, p[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
    q = (hn @ p[pre + "self_attn.q_proj.weight"].T).reshape(t, h, hd)
    k = (hn @ p[pre + "self_attn.k_proj.weight"].T).reshape(t, kvh, hd)
    v = (hn @ p[pre + "self_attn.v_proj.weight"].T).reshape(t, kvh, hd)
    pos = np.arange(t)
    q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
    k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", a, v).reshape(t, h * hd)
    x = x + o @ p[pre + "self_attn.o_proj.weight"].T
    hn = _rms(x, p[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    g = hn @ p[pre + "mlp.gate_proj.weight"].T
    return x + ((g / (1 + np.exp(-g))) * (hn @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T


def reference(p, tokens, cfg):
    """float64 Llama forward: hidden [T, d] and logits [T, V]."""
    x = p["model.embed_tokens.weight"][tokens]
    for i in range(cfg.num_hidden_layers):
        x = _layer(p, f"model.layers.{i}.", x, cfg)
    return x, _rms(x, p["model.norm.weight"], cfg.rms_norm_eps) @ p["lm_head.weight"].T


def reference_mtp(p, hidden, tokens, cfg):
    e = p["model.embed_tokens.weight"][tokens]
    x = np.concatenate([_rms(hidden, p["mtp.hnorm.weight"], cfg.rms_norm_eps),
                        _rms(e, p["mtp.enorm.weight"], cfg.rms_norm_eps)], -1) @ p["mtp.eh_proj.weight"].T
    return _layer(p, "mtp.layer.", x, cfg)


def _params():
    p = init_params(CFG, 3, {**target_tensor_shapes(CFG), **mtp_tensor_shapes(CFG)})
    rng = np.random.default_rng(4)
    for k in p:  # non-trivial norms and larger weights
        p[k] = (p[k] * (1 + 0.5 * rng.standard_normal(p[k].shape)) * (1 if p[k].ndim == 1 else 8)).astype(np.float32)
    return p


def _run_cached(backend, p, chunks, fused=False):
    """Feed the token chunks of one request through the KV cache; returns hidden/logits of all positions."""
    ops = make_ops(RuntimeConfig(backend=backend))
    dp = {k: ops.from_numpy(v) for k, v in p.items()}
    if fused:
        dp.update(fuse_projections(ops, dp, [f"model.layers.{i}." for i in range(CFG.num_hidden_layers)]))
    cache = KVCache(ops, CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, 3, 64)
    rope = Rope(ops, CFG, 64)
    slot = cache.allocate("r").slot
    start, hs, ls = 0, [], []
    for chunk in chunks:
        lay = layout_rows([Row(slot, start, np.asarray(chunk))], len(chunk) + 2, cache.scratch_slot, 64)  # padded
        t = lambda a: ops.from_numpy(a, "int64")  # noqa: E731
        meta = build_attn_meta(ops, rope, t(lay.write_slots), t(lay.positions), t(lay.read_slots), 64, 64,
                               CFG.num_attention_heads // CFG.num_key_value_heads)
        with ops.no_grad():
            h = target_forward(ops, dp, CFG, t(lay.tokens), meta, cache.layers)
            lg = lm_head(ops, dp, CFG, h)
        hs.append(ops.to_numpy(h)[0, : len(chunk)])
        ls.append(ops.to_numpy(lg)[0, : len(chunk)])
        start += len(chunk)
    return np.concatenate(hs), np.concatenate(ls)


@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_cached_chunks_match_reference(backend):
    p = _params()
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, 13)
    ref_h, ref_l = reference({k: v.astype(np.float64) for k, v in p.items()}, tokens, CFG)
    # prefill 5, then chunks of 4, 1, 3 (verify-like and decode-like steps)
    h, lg = _run_cached(backend, p, [tokens[:5], tokens[5:9], tokens[9:10], tokens[10:]])
    assert np.abs(h - ref_h).max() / np.abs(ref_h).max() < 1e-5
    assert np.abs(lg - ref_l).max() / np.abs(ref_l).max() < 1e-5
    assert np.array_equal(lg.argmax(-1), ref_l.argmax(-1))


@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_mtp_layer_matches_reference(backend):
    p = _params()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, 6)
    hidden = rng.standard_normal((6, CFG.hidden_size)).astype(np.float32)
    ref = reference_mtp({k: v.astype(np.float64) for k, v in p.items()}, hidden.astype(np.float64), tokens, CFG)
    ops = make_ops(RuntimeConfig(backend=backend))
    dp = {k: ops.from_numpy(v) for k, v in p.items()}
    rope = Rope(ops, CFG, 16)
    pos = ops.from_numpy(np.arange(6)[None], "int64")
    mask = ops.from_numpy(np.tril(np.ones((6, 6), bool))[None], "bool")
    with ops.no_grad():
        g = mtp_forward(ops, dp, CFG, ops.from_numpy(hidden[None]), ops.from_numpy(tokens[None], "int64"), None, None,
                        train_mask=mask, cos_sin=rope.tables(ops, pos))
    g = ops.to_numpy(g)[0]
    assert np.abs(g - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_the_steps_head_path_and_lazy_meta_equal_the_plain_definitions(backend):
    """The target step's output head (``target_forward(final_norm=True)`` then ``head_argmax``:
    the float32 cast and the argmax in one ``Ops.float_argmax``) gives ``lm_head``'s logits and
    their argmax; ``AttnMeta`` makes the mask and the gathered RoPE rows only when asked, equal
    to the explicit ones."""
    p = _params()
    ops = make_ops(RuntimeConfig(backend=backend))
    dp = {k: ops.from_numpy(v) for k, v in p.items()}
    cache = KVCache(ops, CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, 2, 64)
    rope = Rope(ops, CFG, 64)
    slot = cache.allocate("r").slot
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, 6)
    lay = layout_rows([Row(slot, 0, tokens)], 8, cache.scratch_slot, 64)
    t = lambda a: ops.from_numpy(a, "int64")  # noqa: E731
    groups = CFG.num_attention_heads // CFG.num_key_value_heads
    meta = build_attn_meta(ops, rope, t(lay.write_slots), t(lay.positions), t(lay.read_slots), 64, 64, groups)
    assert "mask" not in vars(meta) and "_cos_sin" not in vars(meta)          # nothing made yet
    want_mask = np.arange(64)[None, None, :] <= lay.positions[:, :, None]
    assert np.array_equal(ops.to_numpy(ops.attention_mask(ops.from_numpy(want_mask, "bool"), groups)),
                          ops.to_numpy(meta.mask))
    cos, sin = rope.tables(ops, t(lay.positions))
    assert np.array_equal(ops.to_numpy(meta.cos), ops.to_numpy(cos))
    assert np.array_equal(ops.to_numpy(meta.sin), ops.to_numpy(sin))
    with ops.no_grad():
        h = target_forward(ops, dp, CFG, t(lay.tokens), meta, cache.layers)
        h2, normed = target_forward(ops, dp, CFG, t(lay.tokens), meta, cache.layers, final_norm=True)
        logits, best = head_argmax(ops, dp, CFG, normed)
        want = ops.to_numpy(lm_head(ops, dp, CFG, h))
    assert np.array_equal(ops.to_numpy(h2), ops.to_numpy(h))
    assert ops.dtype_name(logits) == "float32" and np.array_equal(ops.to_numpy(logits), want)
    assert np.array_equal(ops.to_numpy(best), want.argmax(-1))


def test_paddle_and_torch_agree():
    p = _params()
    tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, 20)
    chunks = [tokens[:7], tokens[7:11], tokens[11:12], tokens[12:16], tokens[16:]]
    hp, lp = _run_cached("paddle", p, chunks)
    ht, lt = _run_cached("torch", p, chunks)
    # Stated tolerance: fp32 logits within 1e-5 relative; identical argmax.
    assert np.abs(lp - lt).max() / np.abs(lp).max() < 1e-5
    assert np.array_equal(lp.argmax(-1), lt.argmax(-1))


def test_fused_projections_match_reference_and_follow_in_place_updates():
    """Torch fuses q/k/v and gate/up into one buffer each; the checkpoint names become views,
    so the fused forward equals the reference, and writing a new weight by name changes it."""
    p = _params()
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, 13)
    chunks = [tokens[:5], tokens[5:9], tokens[9:10], tokens[10:]]
    ref_h, ref_l = reference({k: v.astype(np.float64) for k, v in p.items()}, tokens, CFG)
    h, lg = _run_cached("torch", p, chunks, fused=True)
    assert np.abs(lg - ref_l).max() / np.abs(ref_l).max() < 1e-5
    assert np.array_equal(lg.argmax(-1), ref_l.argmax(-1))

    ops = make_ops(RuntimeConfig(backend="torch"))
    dp = {k: ops.from_numpy(v) for k, v in p.items()}
    fused = fuse_projections(ops, dp, ["model.layers.0."])
    assert set(fused) == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"}
    new_k = np.full_like(p["model.layers.0.self_attn.k_proj.weight"], 0.25)
    ops.copy_from_numpy(dp["model.layers.0.self_attn.k_proj.weight"], new_k)     # as copy_in_place does
    qd = CFG.num_attention_heads * CFG.head_dim
    kd = CFG.num_key_value_heads * CFG.head_dim
    rows = ops.to_numpy(fused["model.layers.0.self_attn.qkv_proj.weight"])
    assert np.array_equal(rows[qd:qd + kd], new_k)
    assert np.array_equal(rows[:qd], p["model.layers.0.self_attn.q_proj.weight"])
    # Paddle slices are not views: nothing is fused there, the forward keeps separate tensors.
    pops = make_ops(RuntimeConfig(backend="paddle"))
    assert fuse_projections(pops, {k: pops.from_numpy(v) for k, v in p.items()}, ["model.layers.0."]) == {}
