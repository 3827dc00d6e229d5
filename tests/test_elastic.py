"""Jobs launched as they run in production, with ``torchrun`` on 127.0.0.1: two simulated nodes
that share rank 0's artifact, and an elastic restart that resumes from the saved pair and the
last checkpoint (``elastic_worker.py`` is what each worker runs)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import distributed_env, free_port, launch

TESTS_DIR = Path(__file__).parent
LAUNCH_TIMEOUT_S = 600
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built into this torch"
)


def _torchrun(*options: str) -> list[str]:
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    base = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    return [*base, "--rdzv-backend", "c10d", "--local-addr", "127.0.0.1", *options]


def _reports(out: Path, mode: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}-rank*.json"))]


def _run(commands: list[list[str]], out: Path) -> None:
    logs = [out / f"launch{i}.log" for i in range(len(commands))]
    statuses = launch(commands, logs, distributed_env(OMP_NUM_THREADS="1"), LAUNCH_TIMEOUT_S)
    for log, status in zip(logs, statuses, strict=True):
        assert status == 0, log.read_text()[-4000:]


def test_two_nodes_share_rank_zeros_artifact(tmp_path: Path) -> None:
    """Two ``torchrun --nnodes 2 --nproc-per-node 2`` launches: every rank of both nodes holds
    the identical pair, and the fully_shard job trains like single-process eager."""
    endpoint = f"127.0.0.1:{free_port()}"
    command = _torchrun(
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "two-nodes",
        str(TESTS_DIR / "elastic_worker.py"),
        "two_nodes",
        str(tmp_path),
    )
    _run([command, command], tmp_path)
    reports = _reports(tmp_path, "two_nodes")
    assert len(reports) == 4
    assert {(r["node"], r["local_rank"]) for r in reports} == {
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    }
    assert len({r["digest"] for r in reports}) == 1
    assert all(r["param"] <= TOLERANCE for r in reports)


@pytest.mark.default_release  # the saved pair found again: the package's own files
def test_restart_resumes_from_the_saved_pair(tmp_path: Path) -> None:
    """``torchrun --max-restarts 1``: a rank dies after 3 of 6 steps; every worker restarts,
    loads the saved pair and the last checkpoint, and the final parameters equal an
    uninterrupted eager run's."""
    command = _torchrun(
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        str(TESTS_DIR / "elastic_worker.py"),
        "restart",
        str(tmp_path),
    )
    _run([command], tmp_path)
    reports = _reports(tmp_path, "restart")
    assert [r["attempt"] for r in reports] == [1, 1]  # only the restarted workers finished
    assert all(r["resumed_from"] == 3 for r in reports)
    assert all(r["param"] <= TOLERANCE for r in reports)
    assert not any(r["compiler_called"] for r in reports)  # loaded, never compiled
    # Rank 1 was lost after step 3. (Which failure torchrun's log names first, the lost rank's
    # or the other rank's, whose next collective fails, is a race.)
    assert (tmp_path / "lost-rank").read_text() == "1"
