"""``specsplit train-mtp`` on a tiny checkpoint written by transformers (CPU, seconds).

A random transformers ``LlamaForCausalLM`` (byte vocabulary, no specsplit
training) is the frozen target. Covers: a few steps write ``mtp.safetensors``
and the held-out acceptance JSON; a resumed run continues from its checkpoint
(and ends bit-identical to an uninterrupted run); the head serves speculatively
with greedy output equal to target-only and to transformers' ``generate``;
bad arguments are one-line errors.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.backends.torch_mtp_distill import CKPT_DIR, latest_checkpoint, run_distill  # noqa: E402
from runtime.checkpoint import index_checkpoint, load_tensors  # noqa: E402
from runtime.config import CacheConfig, EngineConfig, RuntimeConfig, SamplingParams, SpecConfig  # noqa: E402
from runtime.distill_options import DistillOptions  # noqa: E402
from runtime.engine import GenRequest, SpecEngine  # noqa: E402
from runtime.tokenizer import ByteTokenizer  # noqa: E402
from specsplit import cli  # noqa: E402
from tests import hf_models  # noqa: E402

CORPUS = [str(p) for p in sorted((hf_models.Path(__file__).resolve().parents[2] / "runtime").glob("*.py"))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_target")
    model = hf_models.build("llama", d, seed=4, vocab_size=258, bos_token_id=256, eos_token_id=257,
                            max_position_embeddings=256)
    (d / "mtp.safetensors").unlink()                 # train-mtp writes the head; none before
    return d, model


def _opts(target_dir, out, steps, **kw) -> DistillOptions:
    base = dict(batch=2, seq_len=24, unroll=2, save_every=3, keep=2, eval_prompts=2, eval_prompt_len=12,
                eval_tokens=12, eval_k=2, log_every=1, cpu_threads=1)
    return DistillOptions(target=str(target_dir), corpus=CORPUS, out=str(out), steps=steps, **{**base, **kw})


def _head(path) -> dict[str, np.ndarray]:
    return load_tensors(index_checkpoint(path))


def test_train_mtp_writes_a_head_and_resumes_where_it_stopped(target, tmp_path):
    d, _ = target
    lines: list[str] = []
    report = run_distill(_opts(d, tmp_path / "full", 6), say=lines.append)
    assert report["steps_done"] == 6 and report["resumed_from"] is None
    acc = json.loads((tmp_path / "full" / "mtp_acceptance.json").read_text())
    assert len(acc["acceptance"]["per_position"]) == 2 and acc["acceptance"]["spec_rounds"] > 0
    assert len(acc["teacher_forced_agree_per_pass"]) == 3
    assert any("per position" in ln for ln in lines)
    ckpts = sorted(p.name for p in (tmp_path / "full" / CKPT_DIR).iterdir())
    assert ckpts == ["step-00000003.pt", "step-00000006.pt"]

    # An interrupted run: the same options, its last checkpoint lost -> resumes at step 3.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full" / CKPT_DIR, part / CKPT_DIR)
    (part / CKPT_DIR / "step-00000006.pt").unlink()
    assert latest_checkpoint(part / CKPT_DIR).name == "step-00000003.pt"
    lines.clear()
    report = run_distill(_opts(d, part, 6), say=lines.append)
    assert report["resumed_from"] == 3 and report["steps_done"] == 6
    assert any("resuming" in ln and "step 3 of 6" in ln for ln in lines)
    # Batches are a function of (seed, step) and AdamW state was restored: the same weights.
    full, resumed = _head(tmp_path / "full" / "mtp.safetensors"), _head(part / "mtp.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        np.testing.assert_allclose(resumed[name], full[name], rtol=0, atol=1e-6, err_msg=name)
    # A checkpoint of another --unroll is refused, naming the file.
    with pytest.raises(Exception, match="step-00000006.pt"):
        run_distill(_opts(d, part, 9, unroll=3), say=lines.append)


def test_trained_head_serves_speculatively_equal_to_target_only_and_transformers(target, tmp_path):
    d, model = target
    run_distill(_opts(d, d, 4), say=lambda _: None)             # mtp.safetensors next to the target
    tok = ByteTokenizer()
    prompts = [tok.encode("def parse(text):\n"), tok.encode("import os\nimport sys\n")]
    outs = {}
    for k in (0, 3):
        eng = SpecEngine(EngineConfig(str(d), runtime=RuntimeConfig(backend="torch"),
                                      spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=2, max_len=128)))
        res = eng.generate([GenRequest(f"p{i}", tuple(p), SamplingParams(max_tokens=40, ignore_eos=True), k)
                            for i, p in enumerate(prompts)])
        outs[k] = [list(r.tokens) for r in res]
        if k:
            assert sum(r.stats.drafted for r in res) > 0
    assert outs[3] == outs[0]
    for p, got in zip(prompts, outs[0]):
        assert got == hf_models.hf_greedy(model, p, 40)[0]


def test_bad_arguments_are_one_line_errors(target, tmp_path, capsys):
    d, _ = target
    cases = [(["train-mtp", "--target", str(tmp_path / "missing"), "--corpus", CORPUS[0]], "--target"),
             (["train-mtp", "--target", str(d)], "--corpus"),
             (["train-mtp", "--corpus", CORPUS[0]], "--target"),
             (["train-mtp", "--target", str(d), "--corpus", str(tmp_path / "nothing-here")], "nothing-here"),
             (["train-mtp", "--target", str(tmp_path), "--corpus", CORPUS[0]], "config.json"),
             (["train-mtp", "--target", str(d), "--corpus", CORPUS[0], "--seq-len", "1000"], "max_position_embeddings")]
    for argv, name in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and name in err and "Traceback" not in err, (argv, err)
