"""CLI errors a user meets first with their own model (issue 11 § Limits and errors)."""

from __future__ import annotations

import socket

import pytest

from specsplit import cli, cli_client


def test_up_without_mtp_file_is_one_line_suggesting_no_draft(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["up", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "mtp.safetensors" in err and "--no-draft" in err and "Traceback" not in err


def test_status_exits_non_zero_when_the_orchestrator_is_unreachable(capsys):
    with socket.socket() as s:                      # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["status", "--address", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.parametrize("status, problems", [
    ({"target": {"state": "LIFECYCLE_STATE_READY"}, "target_error": "", "draft": {"state": "LIFECYCLE_STATE_LOADED"},
      "draft_error": ""}, 0),
    ({"target": {"state": "LIFECYCLE_STATE_READY"}, "target_error": "",
      "draft_error": "no draft configured (target-only serving)"}, 0),
    ({"target": {"state": "LIFECYCLE_STATE_EMPTY"}, "target_error": "", "draft_error": "no draft configured"}, 1),
    ({"target_error": "UNAVAILABLE: connection refused", "draft": {"state": "LIFECYCLE_STATE_READY"},
      "draft_error": ""}, 1),
    ({"target": {"state": "LIFECYCLE_STATE_READY"}, "target_error": "",
      "draft_error": "target-only: draft unreachable"}, 1),
])
def test_status_problems(status, problems):
    assert len(cli_client._status_problems(status)) == problems


@pytest.mark.parametrize("argv, want", [
    (["--token-ids", "1, 2 3"], [1, 2, 3]),
    (["hi", "--chat", "--system", "be brief"], [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}]),
    (["hi"], "hi"),
])
def test_generate_prompt_forms(argv, want):
    args = cli.build_parser(train_args=False).parse_args(["generate", *argv])
    assert cli_client._generate_prompt(args) == want


def test_generate_token_ids_must_be_integers():
    args = cli.build_parser(train_args=False).parse_args(["generate", "--token-ids", "1,x"])
    with pytest.raises(cli.ConfigError, match="--token-ids"):
        cli_client._generate_prompt(args)


def test_up_listens_where_the_client_commands_look_by_default(monkeypatch):
    from specsplit.cli_client import DEFAULT_ADDRESS

    monkeypatch.delenv("SPECSPLIT_ADDRESS", raising=False)      # the clients' default is read at parser build
    parser = cli.build_parser(train_args=False)
    up = parser.parse_args(["up"])
    assert up.port == 50051 and f"{up.host}:{up.port}" == DEFAULT_ADDRESS
    assert parser.parse_args(["generate", "hi"]).address == DEFAULT_ADDRESS
    assert parser.parse_args(["status"]).address == DEFAULT_ADDRESS
    assert parser.parse_args(["demo"]).port == 0                 # the demo talks to its own stack only
