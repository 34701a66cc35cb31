"""``specsplit convert-mtp``: MTP weights in the DeepSeek-V3 layout -> ``mtp.safetensors``.

Owns: the name mapping from a DeepSeek-V3-style MTP layer
(``model.layers.{N}.enorm / hnorm / eh_proj / shared_head.* / embed_tokens``
plus the decoder block) onto specsplit's MTP tensors (``runtime/model.py``
``mtp_tensor_shapes``), validated against the target before anything is
written.

Layout differences it resolves or refuses:
- DeepSeek-V3 feeds ``eh_proj`` with ``[enorm(embed); hnorm(hidden)]``;
  specsplit with ``[hnorm(hidden); enorm(embed)]``: the two column halves swap.
- specsplit's MTP shares the target's embedding, final norm and head. A
  ``shared_head.norm``, ``shared_head.head`` or ``embed_tokens`` that differs
  from the target's is refused (CheckpointError naming it), never dropped.
- The block must be the target's architecture (Llama-family tensors and
  shapes); an MLA / MoE block is refused by name.
- Not convertible, so stated here: specsplit feeds the MTP the target's hidden
  state *before* the final norm (DESIGN § The speculative round); a head
  trained on post-norm states (as some DeepSeek-V3 runtimes feed it) drafts
  less well. Output stays exact either way (drafts are verified).

Must not know: frameworks, gRPC.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from runtime import checkpoint
from runtime.checkpoint import CheckpointError
from runtime.model import MTP_LAYER_PREFIX, mtp_tensor_shapes
from runtime.weights import check_target

_MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")
# DeepSeek-V3 MTP tensors that must equal the target's (specsplit shares them).
_SHARED = {"shared_head.norm.weight": "model.norm.weight", "shared_head.head.weight": "lm_head.weight",
           "embed_tokens.weight": "model.embed_tokens.weight"}


def find_mtp_layer(names: list[str], layer: int | None) -> int:
    found = sorted(int(m.group(1)) for n in names if (m := _MTP_LAYER.match(n)))
    if layer is not None:
        if layer not in found:
            raise CheckpointError(f"no DeepSeek-V3 MTP layer {layer} (model.layers.{layer}.eh_proj.weight); "
                                  f"found layers {found}")
        return layer
    if len(found) != 1:
        raise CheckpointError("expected exactly one DeepSeek-V3 MTP layer (model.layers.N.eh_proj.weight), "
                              f"found {found or 'none'}: choose one with --layer")
    return found[0]


def convert(source: str | Path, target_dir: str | Path, out_path: str | Path, layer: int | None = None) -> Path:
    """Write ``out_path`` (default name ``mtp.safetensors``) from the MTP layer in ``source``."""
    target = check_target(target_dir)
    cfg = target.cfg
    infos = checkpoint.index_checkpoint(source)
    n = find_mtp_layer(list(infos), layer)
    prefix = f"model.layers.{n}."
    mapping: dict[str, str] = {}                                  # ours -> source name
    shared: dict[str, str] = {}                                   # source name -> target name it must equal
    for name in (x for x in infos if x.startswith(prefix)):
        rest = name[len(prefix):]
        if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            mapping["mtp." + rest] = name
        elif rest in _SHARED:
            tname = _SHARED[rest] if (_SHARED[rest] in target.infos) else "model.embed_tokens.weight"
            shared[name] = tname
        else:
            mapping[MTP_LAYER_PREFIX + rest] = name
    expected = mtp_tensor_shapes(cfg)
    checkpoint.validate({ours: infos[src] for ours, src in mapping.items()}, expected,
                        f"DeepSeek-V3 MTP layer {n} in {source} (as specsplit names)", allow_extra=False)
    for src, tname in shared.items():
        if not np.array_equal(checkpoint.read_tensor(infos[src]), checkpoint.read_tensor(target.infos[tname])):
            raise CheckpointError(f"{source}: {src} differs from the target's {tname}; specsplit's MTP shares "
                                  "the target's embedding, final norm and head, so this head cannot be converted")
    tensors = {ours: checkpoint.read_tensor(infos[src]) for ours, src in mapping.items()}
    d = cfg.hidden_size
    eh = tensors["mtp.eh_proj.weight"]                            # [d, 2d]: [enorm(e) | hnorm(h)] columns
    tensors["mtp.eh_proj.weight"] = np.concatenate([eh[:, d:], eh[:, :d]], axis=1)
    out = Path(out_path)
    dtype = cfg.torch_dtype if cfg.torch_dtype in ("float32", "float16", "bfloat16") else "float32"
    checkpoint.save_safetensors(out, tensors, dtype)
    return out
