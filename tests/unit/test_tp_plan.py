"""The tensor-parallel sharding math (runtime/tp_plan.py), in numpy.

Column splits (q/k/v, gate/up) concatenated over the ranks, and row splits (o,
down) summed over the ranks, give the full matmuls; each rank's query heads read
the K/V head they belong to, also when K/V heads are replicated (fewer than ranks);
the head's vocabulary slices reassemble the logits; slices read from a safetensors
file equal slices of the full tensor (F32 and BF16); models or configs that cannot
be split are refused naming the field.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from core.config import ConfigError
from runtime.checkpoint import index_checkpoint, read_tensor, save_target
from runtime.config import ModelConfig, RuntimeConfig
from runtime.model import init_params, target_tensor_shapes
from runtime.tp_plan import TPPlan, read_sharded
from worker.config import WorkerConfig

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, attention_bias=True, mlp_bias=True)


def _params(cfg: ModelConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(a.shape).astype(np.float32)
            for n, a in init_params(cfg, 0, target_tensor_shapes(cfg)).items()}


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_column_and_row_splits_reassemble_the_full_matmuls(tp):
    """tp = 3 divides neither the 4 query heads nor the FFN's 48 rows: balanced shares (2, 1, 1 heads;
    16 rows each), still the full matmuls once concatenated or summed."""
    p, x = _params(CFG), np.random.default_rng(1).standard_normal((3, CFG.hidden_size)).astype(np.float32)
    plans = [TPPlan(CFG, tp, r) for r in range(tp)]
    pre = "model.layers.0."
    for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj"):
        full = x @ p[pre + name + ".weight"].T + p[pre + name + ".bias"]
        parts = [x @ pl.shard(pre + name + ".weight", p[pre + name + ".weight"]).T
                 + pl.shard(pre + name + ".bias", p[pre + name + ".bias"]) for pl in plans]
        np.testing.assert_allclose(np.concatenate(parts, -1), full, rtol=1e-5, atol=1e-5)
    for name, width in (("self_attn.o_proj", CFG.num_attention_heads * CFG.head_dim),
                        ("mlp.down_proj", CFG.intermediate_size)):
        h = np.random.default_rng(2).standard_normal((3, width)).astype(np.float32)
        full = h @ p[pre + name + ".weight"].T + p[pre + name + ".bias"]
        cols = [pl.slice_of(pre + name + ".weight") for pl in plans]            # each rank's input columns
        assert [c.start for c in cols[1:]] == [c.stop for c in cols[:-1]] and cols[-1].stop == width
        total = sum(h[:, c.start:c.stop] @ pl.shard(pre + name + ".weight", p[pre + name + ".weight"]).T
                    + pl.shard(pre + name + ".bias", p[pre + name + ".bias"]) for c, pl in zip(cols, plans))
        np.testing.assert_allclose(total, full, rtol=1e-4, atol=1e-4)       # the all-reduce; bias added once
    # The vocabulary gather: equal parts (64 rows at tp = 3: 22, 21, 21, each padded to 22), the
    # padding's logits dropped.
    head = p["lm_head.weight"]
    parts = [x @ pl.shard("lm_head.weight", head).T for pl in plans]
    assert {part.shape[-1] for part in parts} == {plans[0].vocab_width}
    logits = np.concatenate([part[:, :n] for part, n in zip(parts, plans[0].vocab_counts)], -1)
    np.testing.assert_allclose(logits, x @ head.T, rtol=1e-5, atol=1e-5)
    assert all(not part[:, n:].any() for part, n in zip(parts, plans[0].vocab_counts))     # zero rows


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_each_ranks_query_heads_read_their_own_kv_head(tp):
    """tp=4 > 2 K/V heads: ranks (0, 1) share K/V head 0 and (2, 3) head 1 (replicated); tp=3: ranks 0
    and 1 share K/V head 0 (one query head each), rank 2 holds K/V head 1 with both of its."""
    hd, g = CFG.head_dim, CFG.num_attention_heads // CFG.num_key_value_heads
    k = _params(CFG)["model.layers.0.self_attn.k_proj.weight"]                  # [kvh*hd, d]
    for r in range(tp):
        pl = TPPlan(CFG, tp, r)
        local = pl.local_cfg()
        assert local.num_attention_heads == pl.heads and local.head_dim == CFG.head_dim
        assert local.num_attention_heads % local.num_key_value_heads == 0
        shard = pl.shard("model.layers.0.self_attn.k_proj.weight", k)
        lg = local.num_attention_heads // local.num_key_value_heads
        for j in range(local.num_attention_heads):                               # local query head j
            global_q = pl.q_heads[0] + j
            want = k[(global_q // g) * hd:(global_q // g + 1) * hd]
            got = shard[(j // lg) * hd:(j // lg + 1) * hd]
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("heads,kv_heads,ffn", [(16, 4, 5632), (4, 2, 704), (32, 8, 11008)])
def test_uneven_shares_cover_everything_and_stay_balanced(heads, kv_heads, ffn):
    """Every tp the heads allow: the query heads and FFN rows are partitioned, each rank's query
    heads use its K/V heads in one ratio, the largest share of query heads is the least possible,
    and FFN shares differ by at most one row."""
    cfg = ModelConfig(vocab_size=64, hidden_size=heads * 8, intermediate_size=ffn, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8)
    group = heads // kv_heads
    for tp in range(1, heads + 1):
        if tp > kv_heads and -(-tp // kv_heads) > group:
            with pytest.raises(ConfigError, match=f"tp={tp} is too large"):
                TPPlan(cfg, tp, 0)
            continue
        plans = [TPPlan(cfg, tp, r) for r in range(tp)]
        assert [p.q_heads for p in plans] == sorted(p.q_heads for p in plans)
        assert plans[0].q_heads[0] == 0 and plans[-1].q_heads[1] == heads
        assert all(a.q_heads[1] == b.q_heads[0] for a, b in zip(plans, plans[1:]))
        assert sum(p.ffn_rows[1] - p.ffn_rows[0] for p in plans) == ffn
        assert max(p.ffn_rows[1] - p.ffn_rows[0] for p in plans) - min(p.ffn_rows[1] - p.ffn_rows[0] for p in plans) <= 1
        sizes = [p.heads for p in plans]
        # The largest share is the least any valid split can have: some rank takes ceil(kvh/tp)
        # whole groups, or some group is shared by only floor(tp/kvh) ranks.
        least = -(-kv_heads // tp) * group if tp <= kv_heads else -(-group // (tp // kv_heads))
        assert max(sizes) == least, (tp, sizes)
        for p in plans:
            lg = p.heads // p.kv_heads
            assert p.heads == lg * p.kv_heads
            for j in range(p.heads):                             # local query head j -> its local K/V head
                assert p.kv_start + j // lg == (p.q_heads[0] + j) // group
        if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0):     # the even split of before
            assert sizes == [heads // tp] * tp


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliced_reads_equal_slices_of_the_full_tensors(tmp_path, dtype):
    p = _params(CFG)
    save_target(tmp_path, CFG, p, dtype=dtype, shard_bytes=8192)
    infos = index_checkpoint(tmp_path)
    for r in range(2):
        plan = TPPlan(CFG, 2, r)
        got = read_sharded(infos, list(infos), plan, bf16_bits=dtype == "bfloat16")
        for name, info in infos.items():
            want = plan.shard(name, read_tensor(info, bf16_bits=dtype == "bfloat16"))
            assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
            np.testing.assert_array_equal(got[name], want)
        for r3 in range(3):            # uneven shares (tp = 3): the padded head shard too
            plan3 = TPPlan(CFG, 3, r3)
            got3 = read_sharded(infos, list(infos), plan3, bf16_bits=dtype == "bfloat16")
            for name, info in infos.items():
                want3 = plan3.shard(name, read_tensor(info, bf16_bits=dtype == "bfloat16"))
                assert got3[name].shape == want3.shape, name
                np.testing.assert_array_equal(got3[name], want3)
        if dtype == "bfloat16":        # bits, exactly the stored values
            o = got["model.layers.0.self_attn.o_proj.weight"]
            full = float32_to_bf16_bits(p["model.layers.0.self_attn.o_proj.weight"])
            np.testing.assert_array_equal(bf16_bits_to_float32(o), bf16_bits_to_float32(full[:, r * 16:(r + 1) * 16]))


def test_vocabulary_that_tp_does_not_divide_is_split_padded_unless_tied_to_the_embedding():
    cfg = ModelConfig(vocab_size=65, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    plans = [TPPlan(cfg, 2, r) for r in range(2)]
    assert [pl.vocab_rows for pl in plans] == [(0, 33), (33, 65)] and plans[1].vocab_width == 33
    head = np.arange(65 * 32, dtype=np.float32).reshape(65, 32)
    shard = plans[1].shard("lm_head.weight", head)
    assert shard.shape == (33, 32) and (shard[:32] == head[33:]).all() and not shard[32].any()
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    plan = TPPlan(tied, 2, 1)                         # its head is a view of the embedding: kept whole
    assert not plan.vocab_split and plan.vocab_rows == (0, 65) and plan.slice_of("lm_head.weight") is None


def test_models_and_configs_that_cannot_be_split_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="tp=5 is too large for model.num_attention_heads=4"):
        TPPlan(CFG, 5, 0)                         # 2 K/V heads of 2 query heads: 3 ranks would share one
    small = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=3, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="model.intermediate_size=3"):
        TPPlan(small, 4, 0)
    with pytest.raises(ConfigError, match=r"^tp=2 is invalid.*runtime.backend='torch'"):
        WorkerConfig(role="target", target_path=None, tp=2, runtime=RuntimeConfig(backend="paddle"))
    with pytest.raises(ConfigError, match=r"^tp=2 is invalid.*draft"):
        WorkerConfig(role="draft", target_path=None, tp=2, runtime=RuntimeConfig(backend="torch"))
    with pytest.raises(ConfigError, match=r"^tp=0 is invalid"):
        WorkerConfig(role="target", target_path=None, tp=0)
    with pytest.raises(ConfigError, match=r"^tp=2 is invalid.*runtime.batch_invariant"):
        WorkerConfig(role="target", target_path=None, tp=2,
                     runtime=RuntimeConfig(backend="torch", device="cuda:0", batch_invariant=True))
