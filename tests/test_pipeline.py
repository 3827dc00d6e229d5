"""Pipeline parallelism with ``torch.distributed.pipelining`` on gloo over 127.0.0.1: each
stage a differentiable artifact (the module form, captured from a plain example: later stages
get activations that require grad at the call), under GPipe and 1F1B with 4 micro-batches,
matching single-process eager over three AdamW steps (``pipeline_worker.py``); and PP x FSDP2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_ranks

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available(),
        reason="torch.distributed is not built into this torch",
    ),
    pytest.mark.timeout(1200),
]
CASES = ["gpipe_eager", "1f1b_eager", "gpipe_inductor", "1f1b_inductor"]
ONE_RANK = ["onerank_eager", "onerank_inductor"]
TOLERANCE = 1e-5


# Four stages run the same schedules as two, on more ranks: once, on the default release.
@pytest.fixture(
    scope="module",
    params=[2, pytest.param(4, marks=pytest.mark.default_release)],
    ids=["2_stages", "4_stages"],
)
def stages(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = request.param
    return run_ranks(
        world,
        [*ONE_RANK, *CASES],
        tmp_path_factory.mktemp(f"pipeline{world}"),
        worker="pipeline_worker.py",
    )


@pytest.mark.parametrize("case", CASES)
def test_precompiled_stages_train_like_eager(stages: list[dict[str, Any]], case: str) -> None:
    for rank, report in enumerate(stages):
        result = report[case]
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
        assert result["differentiable"], rank
        assert result["moved"] > 1e-3, rank  # the stage trained at all
        assert result["max_diff"] <= TOLERANCE, (rank, result["max_diff"])


@pytest.mark.parametrize("case", ONE_RANK)
def test_one_rank_builds_every_stage(stages: list[dict[str, Any]], case: str) -> None:
    for rank, report in enumerate(stages):
        result = report[case]
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
        assert bool(result["build_modules"]) == (rank == 0), rank  # only rank 0 built
        assert result["max_diff"] <= TOLERANCE, (rank, result["max_diff"])


@pytest.mark.default_release  # saved pairs found again: the package's own files
def test_restarted_stages_resume_from_their_saved_pairs(tmp_path: Path) -> None:
    """Two steps, every rank saves its pair and state; new processes load them (building
    nothing) and train the third step, which matches eager's three."""
    run_ranks(2, ["save_eager", "save_inductor"], tmp_path, worker="pipeline_worker.py")
    reports = run_ranks(
        2, ["resume_eager", "resume_inductor"], tmp_path, worker="pipeline_worker.py"
    )
    for rank, report in enumerate(reports):
        for case in ("resume_eager", "resume_inductor"):
            result = report[case]
            assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
            assert result["build_modules"] == [], rank
            assert result["max_diff"] <= TOLERANCE, (rank, case, result["max_diff"])


@pytest.fixture(scope="module")
def pp_fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(
        4,
        ["fsdp_eager", "fsdp_inductor", "innershard_eager"],
        tmp_path_factory.mktemp("pp_fsdp"),
        worker="pipeline_worker.py",
    )


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_pipeline_stages_sharded_with_fsdp2_train_like_eager(
    pp_fsdp: list[dict[str, Any]], backend: str
) -> None:
    """PP x FSDP2 on 4 ranks (2 stages x 2 shards): each precompiled stage sharded as a whole
    with ``fully_shard``, each replica on its own rows, matches eager over the whole batch."""
    for rank, report in enumerate(pp_fsdp):
        result = report[f"fsdp_{backend}"]
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
        assert result["sharded"] and result["differentiable"], rank
        assert result["moved"] > 1e-3, rank
        assert result["max_diff"] <= TOLERANCE, (rank, result["max_diff"])


def test_a_block_sharded_after_capture_is_refused(pp_fsdp: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(pp_fsdp):
        refused = report["innershard_eager"].get("refused")
        assert refused and "Shard the precompiled module as a whole" in refused, (rank, report)
