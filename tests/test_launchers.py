"""The strategy under torchrun: single node, two simulated nodes, and a rank that fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port
from tests.lightning_tasks import FlowMatching, Samples, param_rel_err, read_records, reference_params

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fit_tiny.py"


def torchrun(*args, nproc=4, nnodes=1, node_rank=0, port=None, timeout=300, **popen):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_GLOBAL_SEED": "0"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--master-addr=127.0.0.1",
        f"--master-port={port or free_port()}",
        str(SCRIPT),
        *map(str, args),
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_torchrun_dp2_cp2_matches_one_process(tmp_path):
    code, out = finish(torchrun("--cp", 2, "--out", tmp_path / "params.pt"))
    assert code == 0, out[-3000:]
    torch.manual_seed(0)
    reference = reference_params(FlowMatching(), Samples(), 4, 5, clip=None, seed=0)
    params = torch.load(tmp_path / "params.pt")
    assert param_rel_err(params, reference) <= 1e-5


def test_two_simulated_nodes_keep_cp_groups_inside_a_node(tmp_path):
    port = free_port()
    args = ("--devices", 2, "--num-nodes", 2, "--cp", 2, "--steps", 2, "--record-dir", tmp_path)
    nodes = [torchrun(*args, nproc=2, nnodes=2, node_rank=rank, port=port) for rank in (0, 1)]
    results = [finish(node) for node in nodes]
    for code, out in results:
        assert code == 0, out[-3000:]
    rows = read_records(tmp_path)
    assert {r["rank"] for r in rows} == {0, 1, 2, 3} and {r["step"] for r in rows} == {0, 1}
    for row in rows:
        node = row["rank"] // 2
        assert all(member // 2 == node for member in row["cp_group"]), row  # the CP group is on this node


@pytest.mark.parametrize("fail_rank", [1, 3])
def test_a_failing_rank_stops_every_process(fail_rank):
    timeout = 30
    start = time.monotonic()
    proc = torchrun("--fail-at-step", 2, "--fail-rank", fail_rank, "--timeout", timeout)
    code, out = finish(proc, timeout=timeout * 4)
    elapsed = time.monotonic() - start
    assert code != 0, out[-3000:]
    assert "deliberate failure at step 2" in out
    assert elapsed < timeout * 3, elapsed  # stopped within the collective timeout (plus start-up), no hang
