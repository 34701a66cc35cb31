"""docs/api.md is generated from the .proto comments and cannot drift from them (issue 13)."""

from __future__ import annotations

from pathlib import Path

from protos.api_doc import descriptor_set, render

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_api_doc_is_generated_from_the_protos():
    expected = render(descriptor_set())
    assert API_DOC.exists(), "docs/api.md is missing: python -m protos.api_doc > docs/api.md"
    assert API_DOC.read_text() == expected, "docs/api.md is stale: run `python -m protos.api_doc > docs/api.md`"


def test_api_doc_covers_every_rpc_message_and_comment():
    """Every service, RPC, message, field and enum value of specsplit.v1 is on the page, with its comment;
    a changed comment changes the page (so the drift check above can fail)."""
    fds = descriptor_set()
    page = render(fds)
    ours = [f for f in fds.file if f.package == "specsplit.v1"]
    assert ours
    for fdp in ours:
        for svc in fdp.service:
            assert f"service `specsplit.v1.{svc.name}`" in page
            for m in svc.method:
                assert f"| `{m.name}` |" in page, m.name
        for msg in fdp.message_type:
            assert f"message `{msg.name}`" in page, msg.name
            for f in msg.field:
                assert f"| `{f.name}` | {f.number} |" in page, (msg.name, f.name)
        for enum in fdp.enum_type:
            for v in enum.value:
                assert f"| `{v.name}` | {v.number} |" in page
    assert "0 (unset) means off" in page                      # top_p: what reflection cannot say
    loc = next(loc for f in ours for loc in f.source_code_info.location
               if loc.leading_comments.strip() and list(loc.path[:1]) == [4] and len(loc.path) == 2)   # a message
    loc.leading_comments = " a different comment\n"
    assert render(fds) != page
