"""Generated admin tokens, token files and which token the orchestrator presents to a worker."""

from __future__ import annotations

import stat

import pytest

from core import admin_token as at


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_RUNTIME_DIR", str(tmp_path / "rt"))
    return tmp_path / "rt"


def test_token_file_is_private_and_found_only_for_loopback(runtime):
    path = at.write_token_file(at.default_token_path(5123), "tok-abc")
    assert path == runtime / "admin-5123.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert at.find_admin_token("127.0.0.1:5123") == "tok-abc"
    assert at.find_admin_token("localhost:5123") == "tok-abc"
    assert at.find_admin_token("[::1]:5123") == "tok-abc"
    assert at.find_admin_token("10.0.0.5:5123") is None          # never sent to another machine
    assert at.find_admin_token("127.0.0.1:5124") is None


def test_runtime_dir_precedence(tmp_path):
    assert at.runtime_dir({"SPECSPLIT_RUNTIME_DIR": "/a", "XDG_RUNTIME_DIR": "/b"}) == at.Path("/a")
    assert at.runtime_dir({"XDG_RUNTIME_DIR": "/b"}) == at.Path("/b/specsplit")
    assert at.runtime_dir({}).parts[-3:] == ("share", "specsplit", "runtime")


def test_fingerprint_names_without_revealing():
    fp = at.fingerprint("a-secret-token")
    assert fp.startswith("sha256:") and len(fp) == 19 and "secret" not in fp
    assert fp == at.fingerprint(b"a-secret-token") != at.fingerprint("another")


def test_token_for_worker_order(runtime):
    """worker token > this process's own generated worker > own admin token (one setting) >
    the loopback worker's token file > this process's token; nothing for remote workers."""
    at.write_token_file(at.default_token_path(7001), "worker-file-token")
    assert at.token_for_worker("w", "own", "127.0.0.1:7001") == "w"
    assert at.token_for_worker(None, "own", "127.0.0.1:7001") == "own"
    assert at.token_for_worker(None, None, "127.0.0.1:7001") == "worker-file-token"
    assert at.token_for_worker(None, "own", "10.1.2.3:7001") == "own"
    assert at.token_for_worker(None, None, "10.1.2.3:7001") is None
    assert at.token_for_worker(None, None, "127.0.0.1:7002") == at.process_token()
    at.serve_generated(7003, at.write_token_file(at.default_token_path(7003), at.process_token()))
    try:                                                                     # a worker of this process
        assert at.token_for_worker(None, "own", "127.0.0.1:7003") == at.process_token()
    finally:
        at.stop_serving(7003)


def test_a_stopped_servers_token_file_goes_and_is_never_taken_for_a_later_server(runtime):
    """CI failure of stop 22: a server of this process with the generated token stopped, its file
    stayed, and a later server on the same port with a configured token was sent this process's
    token (UNAUTHENTICATED). The file goes with the server, and only a live registration counts."""
    path = at.write_token_file(at.default_token_path(7004), at.process_token())
    at.serve_generated(7004, path)
    at.stop_serving(7004)
    assert not path.exists()
    assert at.token_for_worker(None, "own", "127.0.0.1:7004") == "own"
    # A file this process did not write (or one rewritten since) is not ours to remove, and a
    # leftover file holding this process's token no longer outranks the configured token.
    at.write_token_file(path, at.process_token())
    assert at.token_for_worker(None, "own", "127.0.0.1:7004") == "own"
    other = at.write_token_file(at.default_token_path(7005), "another-process")
    at.serve_generated(7005, other)
    at.stop_serving(7005)
    assert other.exists()
