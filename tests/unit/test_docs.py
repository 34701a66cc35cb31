"""Generated documentation matches the code (regenerate with the commands named in each file)."""

from pathlib import Path

from specsplit.metrics_reference import reference_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_metrics_reference_is_current():
    assert (DOCS / "metrics.md").read_text().strip() == reference_markdown().strip(), \
        "docs/metrics.md is stale: run `specsplit metrics-reference > docs/metrics.md`"


def test_metrics_reference_lists_the_reload_metrics():
    """Regression (issue 16): the generated reference lacked the reload metrics the orchestrator serves."""
    text = (DOCS / "metrics.md").read_text()
    for name in ("specsplit_reloads_total", "specsplit_reload_seconds", "specsplit_reload_phase_seconds"):
        assert f"`{name}`" in text, name
