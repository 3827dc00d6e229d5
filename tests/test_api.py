"""The public surface: arguments, the precompile object, threads and forks."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import subprocess
import sys
import types

import pytest
import torch

import torch_precompile
from torch_precompile import PrecompileError, precompile

from conftest import assert_same, in_threads, run_python
from workloads import WORKLOADS


def test_public_names() -> None:
    assert torch_precompile.__all__ == [
        "PrecompileError",
        "__version__",
        "capture",
        "load",
        "precompile",
    ]
    assert torch_precompile.capture.__module__ == "torch_precompile.capture_session"
    assert precompile.PrecompileError is PrecompileError
    assert issubclass(PrecompileError, RuntimeError)
    assert PrecompileError.__module__ == "torch_precompile"


def test_object_identity_and_introspection() -> None:
    assert pickle.loads(pickle.dumps(precompile)) is precompile
    assert copy.deepcopy(precompile) is precompile and copy.copy(precompile) is precompile
    assert repr(precompile) == "torch_precompile.precompile"
    assert precompile.__name__ == "precompile"
    assert precompile.PrecompileError is PrecompileError
    assert PrecompileError.__module__ == "torch_precompile"
    parameters = inspect.signature(precompile).parameters
    assert {name: p.default for name, p in parameters.items() if p.default is not p.empty} == {
        "backend": "inductor",
        "tracer": "make_fx",
        "decompositions": None,
        "sign_key": None,
        "progress": None,
        "compile_on_one_rank": False,
        "wrapper": "auto",
        "require_all_guards": False,
        "device": None,
        "blocks": None,
    }
    for method in (precompile.load, precompile.save, precompile.load_file, precompile.inspect):
        assert method.__doc__ and len(method.__doc__.split()) > 8, method
    # Pickled in one process, it is the same object in another.
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sys, torch_precompile; "
            "print(pickle.loads(sys.stdin.buffer.read()) is torch_precompile.precompile)",
        ],
        input=pickle.dumps(precompile),
        capture_output=True,
        timeout=120,
    )
    assert proc.stdout.strip() == b"True", proc.stderr


def test_unknown_backend_and_tracer() -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    with pytest.raises(ValueError, match="backend must be one of"):
        precompile(lambda m, x: m(x), model, x, backend="tvm")
    with pytest.raises(ValueError, match="tracer must be one of"):
        precompile(lambda m, x: m(x), model, x, tracer="jit")
    with pytest.raises(PrecompileError, match="require_all_guards=True asks about the guards"):
        precompile(lambda m, x: m(x), model, x, require_all_guards=True)


def test_bad_fn_and_decompositions() -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    with pytest.raises(PrecompileError, match="fn must be callable"):
        precompile(model.state_dict(), model, x, backend="eager")
    with pytest.raises(PrecompileError, match="decompositions must be a mapping"):
        precompile(lambda m, x: m(x), model, x, backend="eager", decompositions=[1])


def test_options_are_checked_once_when_made() -> None:
    from torch_precompile.options import BuildOptions

    options = BuildOptions(backend="eager", sign_key=b"k")
    assert (options.backend, options.tracer, options.sign_key) == ("eager", "make_fx", b"k")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.backend = "inductor"  # type: ignore[misc]
    with pytest.raises(ValueError, match="backend must be one of"):
        BuildOptions(backend="tvm")
    assert BuildOptions(tracer="dynamo", require_all_guards=True).require_all_guards
    with pytest.raises(PrecompileError, match="decompositions must be a mapping"):
        BuildOptions(decompositions=[1])  # type: ignore[arg-type]


def test_the_pair_is_a_named_tuple() -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    pair = precompile(lambda m, x: m(x), model, x, backend="eager")
    code, cache = pair
    assert (pair.code, pair.cache) == (code, cache) and pair == (code, cache)
    assert type(pair).__name__ == "ArtifactPair" and len(pair) == 2
    assert pickle.loads(pickle.dumps(pair)) == pair


@pytest.mark.lowering
def test_concurrent_captures_from_threads(backend: str) -> None:
    model, x, t = WORKLOADS["mlp_train"].args()
    results: dict[int, tuple[str, bytes]] = {}

    def work(i: int) -> None:
        scale = float(i + 1)
        results[i] = precompile(
            lambda m, x, t: (m(x) * scale - t).square().mean(),
            copy.deepcopy(model),
            x,
            t,
            backend=backend,
        )

    # Builds wait for each other: two threads show it as well as four, and each inductor
    # build costs seconds.
    threads = 4 if backend == "eager" else 2
    errors = in_threads(work, threads)
    assert not errors, errors
    assert sorted(results) == list(range(threads))  # every thread finished with its own pair
    other, x2, t2 = WORKLOADS["mlp_train"].args(1)
    for i, (code, cache) in results.items():
        expected = (other(x2) * (i + 1) - t2).square().mean()
        assert_same(precompile.load(code, cache)(other, x2, t2), expected)


def test_nested_precompile_does_not_deadlock() -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    # A Python side effect in an object of the standard library's, which capture leaves be.
    seen = types.SimpleNamespace(inner=0)

    def fn(m, x):
        if not seen.inner:
            seen.inner += (
                "def captured_graph" in precompile(lambda m, x: m(x) * 2, m, x, backend="eager")[0]
            )
        return m(x)

    precompile(fn, model, x, backend="eager")
    assert seen.inner == 1


def test_fork_while_another_thread_captures() -> None:
    proc = run_python("""
        import os, threading, time, torch
        from torch_precompile import build, precompile
        build._lock.acquire()  # as if another thread were mid-capture when we fork
        pid = os.fork()
        if pid == 0:
            code, cache = precompile(lambda x: x * 2 + 1, torch.ones(2), backend="eager")
            ok = torch.equal(precompile.load(code, cache)(torch.ones(2)), torch.full((2,), 3.0))
            os._exit(0 if ok else 1)
        deadline = time.time() + 120
        while time.time() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("CHILD", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.2)
        else:
            os.kill(pid, 9)
            print("CHILD DEADLOCKED")
    """)
    assert "CHILD 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_computation_without_models(backend: str) -> None:
    x = torch.randn(3)
    code, cache = precompile(lambda a, b: {"sum": a + b, "n": 2}, x, x * 2, backend=backend)
    assert_same(precompile.load(code, cache)(x, x * 2), {"sum": x * 3, "n": 2})


def test_the_version_is_written_once_and_dated_in_the_changelog() -> None:
    """The installed metadata reads ``__version__``; the changelog dates that release."""
    import importlib.metadata
    import re
    from pathlib import Path

    import torch_precompile

    assert importlib.metadata.version("torch-precompile") == torch_precompile.__version__
    changelog = (Path(__file__).parents[1] / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\d+\.\d+\.\d+) \((\d{4}-\d\d-\d\d)\)$", changelog, re.M)
    assert releases and releases[0][0] == torch_precompile.__version__, releases[:1]
