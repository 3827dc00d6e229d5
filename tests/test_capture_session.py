"""``capture()``: the with-block API, its every documented behaviour, and ``load`` from paths."""

from __future__ import annotations

from pathlib import Path

import pytest

import torch_precompile
from torch_precompile import PrecompileError, capture, precompile

from conftest import assert_runs_like_eager, assert_same, model_state, run_python
from workloads import WORKLOADS

NAME = "mlp_train"


def _captured(tmp_path: Path, backend: str = "eager", **paths) -> tuple[object, list]:
    """One capture block around one training step: (its result, eager's result and state)."""
    workload = WORKLOADS[NAME]
    args, eager_args = workload.args(), workload.args()
    expected = workload.fn(*eager_args)
    with capture(workload.fn, artifact_path=tmp_path / "step.py", backend=backend, **paths) as cap:
        result = cap(*args)
    assert_same(result, expected)
    assert_same(model_state(args[0]), model_state(eager_args[0]))  # .grad included
    return cap, args


def test_a_call_runs_for_real_and_the_pair_is_written(tmp_path, backend: str) -> None:
    cap, _ = _captured(tmp_path, backend, cache_path=tmp_path / "step.cache")
    assert cap.pair is not None
    assert (tmp_path / "step.py").read_text() == cap.pair.code
    assert (tmp_path / "step.cache").read_bytes() == cap.pair.cache
    proc = run_python(f"""
        import torch
        import torch_precompile
        from workloads import WORKLOADS
        run = torch_precompile.load({str(tmp_path / "step.py")!r},
                                    {str(tmp_path / "step.cache")!r})
        workload = WORKLOADS[{NAME!r}]
        args, eager_args = workload.args(), workload.args()
        torch.testing.assert_close(run(*args), workload.fn(*eager_args))
        for p, q in zip(args[0].parameters(), eager_args[0].parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        print("PATHS-OK")
    """)
    assert proc.returncode == 0 and "PATHS-OK" in proc.stdout, proc.stderr[-3000:]


def test_without_a_cache_path_the_cache_lies_beside_the_source(tmp_path) -> None:
    cap, _ = _captured(tmp_path)
    caches = list(tmp_path.glob("step.*.cache"))
    assert len(caches) == 1 and caches[0].read_bytes() == cap.pair.cache
    for source in (tmp_path / "step.py", str(tmp_path / "step.py")):
        run = precompile.load(source)
        args, eager_args = WORKLOADS[NAME].args(), WORKLOADS[NAME].args()
        assert_same(run(*args), WORKLOADS[NAME].fn(*eager_args))
    assert torch_precompile.load == precompile.load


def test_save_inside_the_block_writes_before_it_ends(tmp_path) -> None:
    fn, args = WORKLOADS[NAME].fn, WORKLOADS[NAME].args()
    with capture(fn, artifact_path=tmp_path / "a.py", cache_path=tmp_path / "a.cache") as cap:
        with pytest.raises(PrecompileError, match="nothing to save"):
            cap.save()
        cap(*args)
        assert not (tmp_path / "a.py").exists()
        assert cap.save() == tmp_path / "a.py"
        written = (tmp_path / "a.py").stat().st_mtime_ns
    assert (tmp_path / "a.py").stat().st_mtime_ns == written  # the exit kept the saved pair
    precompile.load(tmp_path / "a.py", tmp_path / "a.cache")


def test_a_block_that_raises_writes_nothing_new(tmp_path) -> None:
    fn, args = WORKLOADS[NAME].fn, WORKLOADS[NAME].args()
    path, cache = tmp_path / "a.py", tmp_path / "a.cache"
    with (
        pytest.raises(KeyError, match="in the loop"),
        capture(fn, artifact_path=path, cache_path=cache) as cap,
    ):
        cap(*args)
        raise KeyError("in the loop")
    assert not path.exists() and not cache.exists()
    old_code, old_cache = precompile(
        WORKLOADS["mlp_infer"].fn, *WORKLOADS["mlp_infer"].args(), backend="eager"
    )
    precompile.save(old_code, old_cache, path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(KeyError), capture(fn, artifact_path=path) as cap:
        cap(*args)
        raise KeyError("again")
    assert path.read_text() == old_code and sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_block_without_a_call_raises_and_writes_nothing(tmp_path) -> None:
    with (
        pytest.raises(PrecompileError, match="ended without a call.*cap\\(model, x\\)"),
        capture(WORKLOADS[NAME].fn, artifact_path=tmp_path / "a.py"),
    ):
        pass
    assert list(tmp_path.iterdir()) == []


def test_single_use(tmp_path) -> None:
    fn, args = WORKLOADS[NAME].fn, WORKLOADS[NAME].args()
    session = capture(fn, artifact_path=tmp_path / "a.py")
    with pytest.raises(PrecompileError, match="not entered yet: call it inside its with block"):
        session(*args)
    with session as cap:
        with pytest.raises(PrecompileError, match="positional arguments only"):
            cap(args[0], x=args[1], t=args[2])
        cap(*args)
        cap(*args)  # a call of the same kind runs the artifact: no second variant
    assert len(cap._variants) == 1 and "Variants(" not in cap.pair.code
    with pytest.raises(PrecompileError, match="this capture is closed"):
        cap(*args)
    with pytest.raises(PrecompileError, match="single-use"), cap:
        pass
    with pytest.raises(PrecompileError, match="fn must be callable"):
        capture(5, artifact_path=tmp_path / "b.py")
    with pytest.raises(TypeError):
        capture(fn, tmp_path / "b.py")  # artifact_path is keyword-only


def test_errors_of_the_captured_call_reach_the_block(tmp_path) -> None:
    def broken(model, x, t):
        raise ValueError("a bug in fn")

    with (
        pytest.raises(ValueError, match="a bug in fn") as raised,
        capture(broken, artifact_path=tmp_path / "a.py") as cap,
    ):
        cap(*WORKLOADS[NAME].args())
    assert type(raised.value) is ValueError  # fn's own error, not wrapped
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="backend must be one of"):
        capture(broken, artifact_path=tmp_path / "a.py", backend="tvm")
    with pytest.raises(PrecompileError, match=r"unknown keywords \['backnd'\].*sign_key"):
        capture(broken, artifact_path=tmp_path / "a.py", backnd="eager")
    with pytest.raises(PrecompileError, match="artifact_path must be a file's path.*got 5"):
        capture(broken, artifact_path=5)
    (tmp_path / "dir.py").mkdir()
    with (
        pytest.raises(PrecompileError, match="cannot write .*dir.py.*not a directory"),
        capture(WORKLOADS[NAME].fn, artifact_path=tmp_path / "dir.py") as cap,
    ):
        cap(*WORKLOADS[NAME].args())


def test_loading_paths_that_do_not_pair(tmp_path) -> None:
    _captured(tmp_path, cache_path=tmp_path / "step.cache")
    other_code, other_cache = precompile(
        WORKLOADS["mlp_infer"].fn, *WORKLOADS["mlp_infer"].args(), backend="eager"
    )
    (tmp_path / "other.cache").write_bytes(other_cache)
    with pytest.raises(PrecompileError, match="belongs to a different python_code"):
        precompile.load(tmp_path / "step.py", tmp_path / "other.cache")
    with pytest.raises(PrecompileError, match="no cache at"):
        precompile.load(tmp_path / "step.py", tmp_path / "missing.cache")
    with pytest.raises(PrecompileError, match="no artifact at"):
        precompile.load(tmp_path / "missing.py")
    run = precompile.load(other_code, tmp_path / "other.cache")  # source text, cache file
    assert_runs_like_eager(run, "mlp_infer")


def test_a_signed_capture_loads_only_with_its_key(tmp_path) -> None:
    key, fn, args = b"k" * 32, WORKLOADS[NAME].fn, WORKLOADS[NAME].args()
    for cache_path in (None, tmp_path / "a.cache"):
        with capture(
            fn, artifact_path=tmp_path / "a.py", cache_path=cache_path, sign_key=key
        ) as cap:
            cap(*args)
        precompile.load(tmp_path / "a.py", cache_path, verify_key=key)
        with pytest.raises(PrecompileError, match="signature"):
            precompile.load(tmp_path / "a.py", cache_path, verify_key=b"x" * 32)


def test_save_each_leaves_the_variants_of_a_job_killed_midway(tmp_path) -> None:
    """A job collecting three batch sizes is killed during its third call: the pair on disk
    holds the first two variants, loads in a fresh process and runs both."""
    path, cache = tmp_path / "v.py", tmp_path / "v.cache"
    proc = run_python(f"""
        import os, signal, torch
        from torch_precompile import capture

        def step(m, x):
            return m(x).relu().sum()

        model = torch.nn.Linear(4, 3)
        with capture(step, artifact_path={str(path)!r}, cache_path={str(cache)!r},
                     backend="eager", save="each") as cap:
            for batch in (1, 2, 3):
                if batch == 3:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies as the third call begins
                cap(model, torch.randn(batch, 4))
    """)
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = run_python(f"""
        import torch
        from torch_precompile import PrecompileError, load

        run = load({str(path)!r}, {str(cache)!r})
        assert len(run.spec.all_variants) == 2, run.spec.all_variants
        model = torch.nn.Linear(4, 3)
        for batch in (1, 2):
            x = torch.randn(batch, 4)
            torch.testing.assert_close(run(model, x), model(x).relu().sum())
        try:
            run(model, torch.randn(3, 4))
        except PrecompileError:
            print("KILLED-OK")
    """)
    assert proc.returncode == 0 and "KILLED-OK" in proc.stdout, proc.stderr[-3000:]


def test_save_takes_end_or_each(tmp_path) -> None:
    with pytest.raises(PrecompileError, match="save must be 'end'.*or 'each'.*got 'always'"):
        capture(WORKLOADS[NAME].fn, artifact_path=tmp_path / "a.py", save="always")
