"""Distributed artifacts on gloo over 127.0.0.1: DTensor, tensor and data parallelism,
``compile_on_one_rank``, refusals. Each world size runs its cases once (one set of processes,
``distributed_worker.py``); the tests read the per-rank reports. Numbers are compared with
single-process eager on the unsharded model over three SGD steps."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_precompile import precompile

from conftest import run_python, run_ranks

TESTS_DIR = Path(__file__).parent
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built into this torch"
)

# The one-rank build runs first: the test checks that the other ranks never imported the
# build pipeline.
CASES_2 = [
    "tp_mlp_inductor_one_rank",
    "linear_eager",
    "linear_inductor",
    "tp_mlp_eager",
    "tp_mlp_eager_one_rank",
    "tp_mlp_infer_eager",
    "tp_mlp_infer_inductor",
    "tp_block_eager",
    "tp_block_sp_eager",
    "tp_block_sp_inductor",
    "data_parallel_eager",
    "data_parallel_inductor",
    "ddp_eager",
    "ddp_inductor_one_rank",
    "ddp_no_sync_eager",
    "ddp_adamw_eager",
    "ddp_buffers_eager",
    "ddp_buffers_inductor",
    "ddp_refusals",
    "fsdp_eager",
    "fsdp_inductor",
    "fsdp_eager_one_rank",
    "fsdp_inductor_one_rank",
    "fsdp_keep_after_forward",
    "fsdp_mixed_precision",
    "fsdp_divide_factor",
    "fsdp_refusals",
    "ddp_adamw_inductor_one_rank",
    "fsdp_adamw_eager",
    "fsdp_adamw_inductor_one_rank",
    "loss_parallel_eager",
    "loss_parallel_inductor",
    "buffers_eager",
    "buffers_inductor",
    "refusals",
    "uneven_one_rank",
    "rank_zero_artifact",
    "save_and_inspect",
]
# Four ranks for the two-dimensional meshes; the rest as at two ranks, on eager (the
# lowering of each collective is the two-rank world's).
CASES_4 = [
    "tp_mlp_eager_one_rank",
    "tp_mlp_eager",
    "tp_dp_2d_eager",
    "tp_dp_2d_inductor",
    "ddp_eager_one_rank",
    "fsdp_eager",
    "fsdp_refusals",
    "fsdp_tp_2d_eager",
    "fsdp_tp_2d_inductor_one_rank",
    "fsdp_tp_2d_adamw_eager",
    "fsdp_tp_2d_adamw_inductor_one_rank",
    "refusals",
]


# A world of one: FSDP2 over a mesh of size 1, where no collective moves data.
CASES_1 = ["fsdp_eager", "fsdp_inductor", "fsdp_adamw_eager"]
WORLDS = {1: "one_rank", 2: "two_ranks", 4: "four_ranks"}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(1, CASES_1, tmp_path_factory.mktemp("one_rank"))


def _world(request: pytest.FixtureRequest, world: int) -> list[dict[str, Any]]:
    """The reports of the ranks of a world of ``world`` ranks."""
    return request.getfixturevalue(WORLDS[world])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(2, CASES_2, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(4, CASES_4, tmp_path_factory.mktemp("four_ranks"))


def _case(reports: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    results = [report[name] for report in reports]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
    return results


def _matches_eager(
    results: list[dict[str, Any]], keys: tuple[str, ...] = ("loss", "grad", "param")
) -> None:
    for rank, result in enumerate(results):
        for key in keys:
            assert result[key] <= TOLERANCE, (rank, key, result[key])


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_dtensor_parameters_and_inputs_train_like_eager(two_ranks, backend: str) -> None:
    """Three SGD steps, each on the gradients of two batches added up in .grad: losses, the
    .grad after every batch, and the parameters equal eager accumulation's."""
    results = _case(two_ranks, f"linear_{backend}")
    _matches_eager(results)
    for result in results:  # gradients keep the parameters' placements, accumulated as eager
        assert result["accumulating_calls"] == 3  # the second batch of each step adds to .grad
        assert result["grad_placements_after"] == result["param_placements"]
        assert result["param_placements"] == [["Shard(dim=0)"], ["Replicate()"]]


@pytest.mark.parametrize(
    ("world", "case"),
    [
        (2, "tp_mlp_eager"),
        (2, "tp_mlp_inductor_one_rank"),
        (2, "tp_mlp_eager_one_rank"),
        (4, "tp_mlp_eager"),
        (4, "tp_mlp_eager_one_rank"),
    ],
)
def test_tensor_parallel_mlp_training(two_ranks, four_ranks, world: int, case: str) -> None:
    results = _case(two_ranks if world == 2 else four_ranks, case)
    _matches_eager(results)
    for result in results:
        assert result["placements"] == [["Shard(0)"], ["Shard(0)"], ["Shard(1)"], ["Replicate()"]]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_tensor_parallel_mlp_inference(two_ranks, backend: str) -> None:
    for result in _case(two_ranks, f"tp_mlp_infer_{backend}"):
        assert result["out"] <= TOLERANCE


@pytest.mark.parametrize("case", ["tp_block_eager", "tp_block_sp_eager", "tp_block_sp_inductor"])
def test_transformer_block_tensor_and_sequence_parallel(two_ranks, case: str) -> None:
    results = _case(two_ranks, case)
    _matches_eager(results)
    for result in results:
        assert result["infer"] <= 1e-5


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_dtensor_buffers_read_and_updated_in_place(two_ranks, backend: str) -> None:
    for result in _case(two_ranks, f"buffers_{backend}"):
        assert result["out"] <= TOLERANCE
        # Capture traces copies of buffers: only the three calls count, as in eager.
        assert result["calls"] == result["ref_calls"] == 3.0
        assert result["buffer_type"] == "DTensor"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_loss_parallel_cross_entropy_on_sharded_logits(two_ranks, backend: str) -> None:
    _matches_eager(_case(two_ranks, f"loss_parallel_{backend}"))


@pytest.mark.parametrize(
    ("world", "case"), [(2, "tp_mlp_inductor_one_rank"), (4, "tp_mlp_eager_one_rank")]
)
def test_one_rank_compiles_for_all(two_ranks, four_ranks, world: int, case: str) -> None:
    results = _case(two_ranks if world == 2 else four_ranks, case)
    assert len({r["digest"] for r in results}) == 1  # the identical pair on every rank
    assert results[0]["build_modules"]  # rank 0 traced and lowered ...
    for result in results[1:]:  # ... no other rank imported the build pipeline at all
        assert result["build_modules"] == []
    # The graph was checked not to depend on the rank, so it serves every coordinate.
    assert results[0]["meshes"] == [[[world], ["tp"], None]]


def test_every_rank_build_records_its_coordinate(four_ranks) -> None:
    results = _case(four_ranks, "tp_mlp_eager")
    assert [r["meshes"] for r in results] == [[[[4], ["tp"], [rank]]] for rank in range(4)]


def test_another_ranks_artifact_is_refused_on_every_rank(two_ranks) -> None:
    rank0, rank1 = (r["outcome"] for r in _case(two_ranks, "rank_zero_artifact"))
    assert "another rank of the device mesh refused this artifact" in rank0
    assert "sits at coordinate (1,)" in rank1 and "built at coordinate (0,)" in rank1


def test_uneven_shards_refused_at_first_call_not_wrong(two_ranks) -> None:
    rank0, rank1 = (r["outcome"] for r in _case(two_ranks, "uneven_one_rank"))
    assert "this rank's shard has shape (2, 8)" in rank1 and "(3, 8)" in rank1
    assert "another rank of the device mesh refused" in rank0


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_data_parallel_all_reduce_after_each_call(two_ranks, backend: str) -> None:
    _matches_eager(_case(two_ranks, f"data_parallel_{backend}"))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_two_dimensional_mesh_one_artifact_for_all_replicas(four_ranks, backend: str) -> None:
    _matches_eager(_case(four_ranks, f"tp_dp_2d_{backend}"))


@pytest.mark.parametrize(
    ("world", "case"),
    [
        (2, "ddp_eager"),
        (2, "ddp_inductor_one_rank"),
        (4, "ddp_eager_one_rank"),
    ],
)
def test_ddp_model_gradients_are_ddps(two_ranks, four_ranks, world: int, case: str) -> None:
    """A DistributedDataParallel model passed as is: .grad after each call equals eager's on
    the full batch (DDP's average), three SGD steps. The gradients are averaged in one bucket
    (a few hundred bytes, far under DDP's bucket_cap_mb): one all-reduce."""
    results = _case(two_ranks if world == 2 else four_ranks, case)
    _matches_eager(results)
    assert all(result["all_reduces"] == 1 for result in results), results


def test_ddp_no_sync_accumulation(two_ranks) -> None:
    """Accumulation under no_sync() and its refusal are the driver's (the same code on either
    backend; DDP's all-reduce on inductor is test_ddp_model_gradients_are_ddps')."""
    results = _case(two_ranks, "ddp_no_sync_eager")
    _matches_eager(results, ("grad", "param"))
    for result in results:
        assert re.search(
            r"^PrecompileError: argument model: this call is inside no_sync\(\), "
            r"but the artifact was captured outside it",
            result["refused"],
        )


@pytest.mark.parametrize("case", ["ddp_adamw_eager", "ddp_adamw_inductor_one_rank"])
def test_ddp_adamw_step_inside_fn(two_ranks, case: str) -> None:
    _matches_eager(_case(two_ranks, case), ("loss", "param"))


@pytest.mark.parametrize(
    ("world", "case"),
    [
        (1, "fsdp_adamw_eager"),
        (2, "fsdp_adamw_eager"),
        (2, "fsdp_adamw_inductor_one_rank"),
        (4, "fsdp_tp_2d_adamw_eager"),
        (4, "fsdp_tp_2d_adamw_inductor_one_rank"),
    ],
)
def test_fully_shard_adamw_step_inside_fn(request, world: int, case: str) -> None:
    """zero_grad, forward, backward and AdamW's step inside fn under a StepLR schedule, on
    fully_shard (and fully_shard over tensor parallelism): parameters equal single-process
    eager's, and the optimizer's state stays sharded DTensors."""
    results = _case(_world(request, world), case)
    _matches_eager(results, ("loss", "param"))
    assert all(r["state"] == ["DTensor"] for r in results)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_ddp_broadcasts_buffers_like_ddp(two_ranks, backend: str) -> None:
    results = _case(two_ranks, f"ddp_buffers_{backend}")
    _matches_eager(results, ("loss", "grad", "param", "buffer"))
    assert results[0]["inspect"] == [
        "model: DistributedDataParallel, gradients averaged over 2 "
        "ranks, buffers broadcast from rank 0 first"
    ]


DDP_REFUSALS = {
    "find_unused_parameters": r"DistributedDataParallel with find_unused_parameters=True",
    "static_graph": r"DistributedDataParallel with static_graph=True",
    "comm_hook": r"DistributedDataParallel with a communication hook",
    "no_sync_inside_fn": r"fn enters no_sync\(\) of model argument m",
    "partial_backward": r"a backward in fn gave gradients to 2 of the 4 parameters of model "
    r"argument m \(a DistributedDataParallel\)",
    "plain_module": r"argument model was a DistributedDataParallel at capture.*got Sequential|"
    r"argument model was a DistributedDataParallel at capture.*got MLP",
}


def test_ddp_refusals_name_the_option(two_ranks) -> None:
    for messages in _case(two_ranks, "ddp_refusals"):
        for name, pattern in DDP_REFUSALS.items():
            assert messages[name].startswith("PrecompileError: "), (name, messages[name])
            assert re.search(pattern, messages[name]), (name, messages[name])
        assert messages["after_refusals"] == "no error"


@pytest.mark.parametrize(
    ("world", "case"),
    [
        (1, "fsdp_eager"),
        (1, "fsdp_inductor"),
        (2, "fsdp_eager"),
        (2, "fsdp_inductor"),
        (2, "fsdp_eager_one_rank"),
        (2, "fsdp_inductor_one_rank"),
        (2, "fsdp_keep_after_forward"),
        (4, "fsdp_eager"),
    ],
)
def test_fully_shard_model_trains_like_eager(request, world: int, case: str) -> None:
    """fully_shard on each layer and the root: two batches per SGD step, each rank on its
    slice; losses, full gradients and parameters equal single-process eager's on the full
    batches, and .grad stays sharded like FSDP2's. In a world of one, the layers' parameters
    share FSDP2's storage with no gather between: what backward saves stays apart."""
    results = _case(_world(request, world), case)
    _matches_eager(results)
    for result in results:
        assert result["accumulating_calls"] == 3  # every second call added to .grad
        assert result["grad_placements"] == ["(Shard(dim=0),)"]
        assert result["local_shapes"] == [
            [16 // world, 8],
            [16 // world],
            [8 // world, 16],
            [8 // world],
        ]
    if case == "fsdp_eager":
        assert results[0]["inspect"] == [
            "model.up: fully_shard, resharded after forward",
            "model.down: fully_shard, resharded after forward",
        ]


@pytest.mark.parametrize("case", ["fsdp_tp_2d_eager", "fsdp_tp_2d_inductor_one_rank"])
def test_fully_shard_over_tensor_parallel_2d_mesh(four_ranks, case: str) -> None:
    """fully_shard on dp and ColwiseParallel / RowwiseParallel on tp of a (2, 2) mesh:
    training (two batches per step) and inference equal single-process eager."""
    results = _case(four_ranks, case)
    _matches_eager(results, ("loss", "grad", "param", "infer"))
    for result in results:
        assert result["placements"] == sorted(
            [
                "(Shard(dim=0),)",
                "(Shard(dim=0), Replicate())",
                "(Shard(dim=0), Shard(dim=1))",
                "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
            ]
        )
        # One gather per group (the root's holds the norm, on dp alone, and the row-wise down,
        # on dp and tp), and up's again in backward: it was resharded after forward.
        assert result["gathers"] == 3, result["gathers"]


def test_fully_shard_mixed_precision_matches_fsdp2(two_ranks) -> None:
    """bf16 gathers and fp32 reduce-scatters: exactly eager FSDP2's numbers. A model sharded
    with another policy (none, or fp16 gathers) is refused naming both policies, and left as
    it was. Before: it ran the captured bf16 casts without a word."""
    results = _case(two_ranks, "fsdp_mixed_precision")
    _matches_eager(results)
    for r in results:
        assert r["grad_dtype"] == "torch.float32"
        assert re.search(
            r"^PrecompileError: module .* has a MixedPrecisionPolicy that gathers "
            r"parameters in their own dtype .*captured with one that gathers "
            r"parameters in torch\.bfloat16",
            r["no_policy"],
        ), r["no_policy"]
        assert re.search(
            r"gathers parameters in torch\.float16 .*captured with one that "
            r"gathers parameters in torch\.bfloat16",
            r["fp16_gathers"],
        ), r["fp16_gathers"]
        assert r["no_policy_untouched"] and r["fp16_gathers_untouched"]


def test_fully_shard_divide_factor(two_ranks) -> None:
    for result in _case(two_ranks, "fsdp_divide_factor"):
        assert result["grad"] <= TOLERANCE
        assert re.search(
            r"^PrecompileError: module up divides gradients by 2.0 .*captured "
            r"dividing by 3.0",
            result["other_factor"],
        ), result["other_factor"]


FSDP_REFUSALS = {
    "no_gradient_sync": r"module up has set_requires_gradient_sync\(False\): FSDP2 then "
    r"keeps unsharded gradients",
    "all_reduce_hook": r"module up is fully_shard-ed with set_all_reduce_hook",
    "call_without_sync": r"module up has set_requires_gradient_sync\(False\).*Call it with "
    r"gradient sync on",
    "plain_model": r"module up was fully_shard-ed at capture",
}


@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_refusals_name_the_setting(two_ranks, four_ranks, world: int) -> None:
    for messages in _case(two_ranks if world == 2 else four_ranks, "fsdp_refusals"):
        patterns = {
            **FSDP_REFUSALS,
            **({"hsdp": r"fully_shard-ed with a 2-D \(HSDP\) mesh"} if world == 4 else {}),
        }
        for name, pattern in patterns.items():
            assert messages[name].startswith("PrecompileError: "), (name, messages[name])
            assert re.search(pattern, messages[name]), (name, messages[name])
        assert messages["after_refusals"] == "no error"


REFUSALS = {
    "plain_model": r"model parameter .up.weight.: expected a DTensor .*\(Shard\(0\)\) .*got a "
    r"plain tensor",
    "other_placements": r"expected a DTensor .* placements \(Shard\(0\)\).*got shape \(16, 8\) "
    r"with placements \(Shard\(1\)\)",
    "closed_over": r"variable 'closed' closed over by fn",
    "in_place_collective": r"in-place collectives \(c10d.allreduce_",
    "dynamic": r"mark_unbacked .* not supported together with DTensors",
    "beside_dtensors": r"input y is a torch.testing._internal.two_tensor.TwoTensor and other "
    r"tensors are DTensors",
    "nested": r"input x is a DTensor whose local shard is a .*TwoTensor .*nested tensor "
    r"subclasses are not carried",
}


@pytest.mark.parametrize("world", [2, 4])
def test_refusals_name_the_cause(two_ranks, four_ranks, world: int) -> None:
    results = _case(two_ranks if world == 2 else four_ranks, "refusals")
    for messages in results:
        for name, pattern in REFUSALS.items():
            assert messages[name].startswith("PrecompileError: "), (name, messages[name])
            assert re.search(pattern, messages[name]), (name, messages[name])
        if messages is not results[0]:  # ranks outside the mesh are refused by name
            assert re.search(
                r"^PrecompileError: model parameter 'weight' is a DTensor on a "
                r"device mesh this rank is not part of",
                messages["outside_mesh"],
            )
        else:
            assert messages["outside_mesh"] == "no error"
        if world == 4:
            assert re.search(
                r"lives on a cpu device mesh of shape \(2,\) named \('tp',\).*"
                r"captured on a cpu device mesh of shape \(4,\)",
                messages["other_mesh"],
            ), messages["other_mesh"]


def test_save_load_file_and_inspect_per_rank(two_ranks) -> None:
    for rank, result in enumerate(_case(two_ranks, "save_and_inspect")):
        assert result["loss"] <= TOLERANCE
        assert result["path"].endswith(f"rank{rank}/step.py")
        assert result["meshes"] == [["tp"]]
        assert f"mesh 0    : cpu (2,) ('tp',), serves coordinate [{rank}] only" in result["cli"]
        assert re.search(
            r"model parameter 'up.weight' +\(Shard\(0\)\) on mesh 0, global "
            r"\(16, 8\), local \(8, 8\)",
            result["cli"],
        ), result["cli"]


def test_compile_on_one_rank_needs_a_process_group() -> None:
    with pytest.raises(precompile.PrecompileError, match="init_process_group"):
        precompile(
            lambda m, x: m(x),
            torch.nn.Linear(2, 2),
            torch.ones(1, 2),
            backend="eager",
            compile_on_one_rank=True,
        )


def test_collectives_the_package_adds_are_current_and_silent() -> None:
    """The FSDP2 all-gather and reduce-scatter the package traces use torch's current
    functional-collective names: a capture prints no deprecation warning."""
    result = run_python(
        """
        import datetime, socket, warnings
        import torch, torch.distributed as dist
        from torch_precompile.internals.distributed import all_gather_rows, reduce_scatter_sum
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        warnings.simplefilter("error", FutureWarning)
        group = dist.group.WORLD
        assert all_gather_rows(torch.arange(3.0), group).tolist() == [[0.0, 1.0, 2.0]]
        assert reduce_scatter_sum(torch.ones(1, 3), group).tolist() == [1.0, 1.0, 1.0]
        dist.destroy_process_group()
        print("ok")
    """,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
