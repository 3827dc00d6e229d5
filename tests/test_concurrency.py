"""Concurrency: threads sharing one loaded artifact; processes loading one pair at once."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from conftest import TESTS_DIR, in_threads
from workloads import WORKLOADS


def test_threads_share_one_inference_artifact(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_infer", backend)
    model, _ = WORKLOADS["mlp_infer"].args()

    def work(i: int) -> None:
        generator = torch.Generator().manual_seed(i)
        for _ in range(40):
            x = torch.randn(5, 4, generator=generator)
            torch.testing.assert_close(run(model, x), model(x).detach())

    assert in_threads(work, 8) == []


def test_more_model_sets_in_flight_than_the_driver_remembers(backend: str, artifacts) -> None:
    """Sixteen threads, each with its own model, evict one another from the driver's memo."""
    run = artifacts.load("mlp_infer", backend)
    base, _ = WORKLOADS["mlp_infer"].args()
    models = [copy.deepcopy(base) for _ in range(16)]

    def work(i: int) -> None:
        generator = torch.Generator().manual_seed(i)
        for _ in range(30):
            model = models[(i + int(torch.randint(0, 16, (), generator=generator))) % 16]
            x = torch.randn(5, 4, generator=generator)
            torch.testing.assert_close(run(model, x), model(x).detach())

    assert in_threads(work, 16) == []


def test_threads_train_their_own_models_with_one_artifact(backend: str, artifacts) -> None:
    """Six threads, each with its own model and inputs, ten steps each: every loss, the
    accumulated .grad and the BatchNorm statistics equal eager's for that thread's calls (and,
    bit for bit, the same calls made one thread at a time)."""
    run = artifacts.load("mlp_train", backend)
    workload = WORKLOADS["mlp_train"]
    base, x, t = workload.args()

    def steps(i: int, fn) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        model = copy.deepcopy(base)
        losses = [fn(model, x + i, t - i) for _ in range(10)]
        state = {f"{n}.grad": p.grad for n, p in model.named_parameters()}
        return losses, {**state, **dict(model.named_buffers())}

    eager = [steps(i, workload.fn) for i in range(6)]
    sequential = [steps(i, run) for i in range(6)]
    got: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}
    assert in_threads(lambda i: got.__setitem__(i, steps(i, run)), 6) == []
    for i in range(6):
        losses, state = got[i]
        torch.testing.assert_close(losses, eager[i][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state, eager[i][1], rtol=1e-4, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(losses, sequential[i][0], strict=True))
        assert all(torch.equal(state[k], v) for k, v in sequential[i][1].items())
    # The threads' inputs differ, so a thread given another's state could not pass the above.
    assert not torch.allclose(eager[0][1]["fc1.weight.grad"], eager[1][1]["fc1.weight.grad"])


LOADER = """
import sys, torch
from torch_precompile import precompile
from workloads import WORKLOADS
code = open(sys.argv[1]).read()
cache = open(sys.argv[2], "rb").read() if sys.argv[2] != "-" else None
run = precompile.load(code, cache)
model, x = WORKLOADS["mlp_infer"].args()
torch.testing.assert_close(run(model, x), model(x).detach())
print("OK")
"""


@pytest.mark.parametrize("with_cache", [True, False], ids=["with-cache", "without-cache"])
def test_processes_load_one_pair_at_once_on_a_shared_empty_cache_dir(
    with_cache: bool, artifacts, tmp_path
) -> None:
    code, cache = artifacts.pair("mlp_infer", "inductor")
    (tmp_path / "a.py").write_text(code)
    (tmp_path / "a.cache").write_bytes(cache)
    shared = tmp_path / "inductor-cache"
    env = {"PYTHONPATH": str(TESTS_DIR), "TORCHINDUCTOR_CACHE_DIR": str(shared)}
    import os

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOADER,
                str(tmp_path / "a.py"),
                str(tmp_path / "a.cache") if with_cache else "-",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        for _ in range(4)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0 and out.strip() == "OK", err[-3000:]
