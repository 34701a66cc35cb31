"""Progress bars of the long-running commands (bench, train, reload, push): tqdm on stderr.

Owns: one way to make a bar, so every command behaves alike: shown when stderr
is a terminal (tqdm's ``disable=None``), silent in pipes and logs, never on
stdout (which carries results and JSON).

Must not know: what is being counted.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

from tqdm import tqdm


def progress(iterable: Iterable[Any] | None = None, *, desc: str, total: float | None = None, unit: str = "it",
             **kw: Any) -> tqdm:
    """A tqdm bar on stderr (off when stderr is not a terminal, unless ``disable=False``)."""
    kw.setdefault("disable", None)
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                mininterval=0.5, **kw)
