"""A tensor-parallel target started the torchrun way: two `specsplit target --tp 2` processes.

Each process gets torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT: rank 0 serves
gRPC, rank 1 follows (it serves nothing). Greedy target-only output equals TP=1's; SIGTERM
to rank 0 stops both ranks in order (rank 1 exits 0 after rank 0's stop command). Also:
`--tp 2` with the Paddle backend is a configuration error naming `tp`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

from core.admin_token import process_token
from tests.ports import free_port
from orchestrator.round_client import RemoteRounds
from rounds.worker_clients import TargetClient
from specsplit import cli
from tests.integration.test_tp_target import TIMEOUT, TINY, _generate, _reference

REPO = TINY.parents[1]


def _rank(rank: int, port: int, logs) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECSPLIT_")},
           "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SPECSPLIT_SECURITY_ADMIN_TOKEN": process_token(),
           "SPECSPLIT_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "target_service", "--tp", "2", "--target-path", str(TINY),
                             "--runtime-backend", "torch", "--server-host", "127.0.0.1", "--server-port", "0",
                             "--cache-max-slots", "4", "--cache-max-len", "256", "--graphs-batch-buckets", "1,4"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(logs / f"rank{rank}.err", "w"), text=True)


def test_torchrun_style_ranks_equal_tp1_and_stop_in_order(tmp_path):
    port = free_port()
    ranks = [_rank(0, port, tmp_path), _rank(1, port, tmp_path)]       # stderr of each: tmp_path/rank<r>.err
    try:
        # The listening line, within a deadline (rank 0 prints it once it serves).
        ready = select.select([ranks[0].stdout], [], [], TIMEOUT)[0]
        assert ready, f"rank 0 did not listen within {TIMEOUT}s"
        line = ranks[0].stdout.readline()
        assert line, "rank 0 exited before listening"
        address = json.loads(line)["address"]
        client = TargetClient(address, timeout_s=TIMEOUT, max_message_bytes=1 << 26, admin_token=process_token())
        rounds = RemoteRounds(client, control_timeout_s=TIMEOUT)
        try:
            rounds.configure("", 4, 8, TIMEOUT)
            assert _generate(rounds, "torchrun", 0) == _reference(TINY)
        finally:
            rounds.stop()
            client.close()
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(timeout=TIMEOUT) == 0
        assert ranks[1].wait(timeout=TIMEOUT) == 0               # stopped by rank 0, not killed
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=TIMEOUT)


def test_tp_with_paddle_is_a_configuration_error_naming_tp(capsys):
    assert cli.main(["target", "--tp", "2", "--runtime-backend", "paddle"]) == 2
    err = capsys.readouterr().err
    assert "configuration error: tp=2 is invalid" in err and "runtime.backend='torch'" in err
