"""The artifact's compiled module in the cache: a load with it compiles nothing, and only the
module the source's seal names for that very source ever runs."""

from __future__ import annotations

import logging
import traceback

import pytest

from torch_precompile import PrecompileError, precompile, runtime
from torch_precompile.artifact import bytecode, envelope

from conftest import assert_same, run_python
from workloads import WORKLOADS

# The inductor twin of each test here is kept: Inductor's lowering is part of what it checks.
pytestmark = pytest.mark.lowering

NAME = "mlp_train"


def _envelope(cache: bytes) -> dict:
    return envelope.decode(cache)


def _repack(code: str, cache: bytes, **changes) -> bytes:
    outer = {**_envelope(cache), **changes}
    return envelope.pack(outer["backend"], code, outer["artifact"], outer.get("compiled"))


def _runs_right(run) -> None:
    workload = WORKLOADS[NAME]
    args, expected_args = workload.args(), workload.args()
    assert_same(run(*args), workload.fn(*expected_args))
    for got, want in zip(args[0].parameters(), expected_args[0].parameters(), strict=True):
        assert_same(got.grad, want.grad)


def test_the_source_ends_with_its_seal(backend: str, artifacts) -> None:
    code, cache = artifacts.pair(NAME, backend)
    last = code.splitlines()[-3:]
    assert last[0].startswith("# The cache holds this file compiled by CPython (magic ")
    assert all(len(line) <= 100 for line in last)
    entry = _envelope(cache)["compiled"]
    assert entry["magic"] == bytecode.MAGIC and isinstance(entry["module"], bytes)
    assert bytecode.unseal(code, entry) is not None


def test_a_load_with_the_cache_compiles_nothing(backend: str, artifacts, tmp_path) -> None:
    """In a fresh process, with Python's compiler (so also ast.parse) refusing artifact text."""
    code, cache = artifacts.pair(NAME, backend)
    (tmp_path / "a.py").write_text(code)
    (tmp_path / "a.cache").write_bytes(cache)
    proc = run_python(f"""
        import builtins, torch
        from torch_precompile import precompile
        from workloads import WORKLOADS
        compile_anything = builtins.compile
        def no_artifact_compiler(source, *args, **kwargs):
            if "ARTIFACT_SPEC" in str(source):
                raise AssertionError("the artifact's source was compiled")
            return compile_anything(source, *args, **kwargs)
        builtins.compile = no_artifact_compiler
        run = precompile.load(open({str(tmp_path / "a.py")!r}).read(),
                              open({str(tmp_path / "a.cache")!r}, "rb").read())
        args, eager_args = WORKLOADS[{NAME!r}].args(1), WORKLOADS[{NAME!r}].args(1)
        torch.testing.assert_close(run(*args), WORKLOADS[{NAME!r}].fn(*eager_args))
        ours, eager = (a for a in args if isinstance(a, torch.nn.Module)), (
            a for a in eager_args if isinstance(a, torch.nn.Module))
        for model, eager_model in zip(ours, eager, strict=True):
            for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad)
        print("NO-COMPILE-OK")
    """)
    assert proc.returncode == 0 and "NO-COMPILE-OK" in proc.stdout, proc.stderr[-3000:]


def test_without_a_usable_entry_the_source_is_compiled(
    backend: str, artifacts, caplog, monkeypatch
) -> None:
    """Each load that finds no usable compiled module compiles the artifact's source (under
    its traceback name) and runs right; one with the intact entry compiles nothing."""
    code, cache = artifacts.pair(NAME, backend)
    compiled: list[tuple[str, str]] = []

    def counting_compile(source, filename, mode, *args, **kwargs):
        compiled.append((filename, mode))
        return compile(source, filename, mode, *args, **kwargs)

    # The load's only compile() of the artifact, seen where it is made.
    monkeypatch.setattr(runtime, "compile", counting_compile, raising=False)
    entry = _envelope(cache)["compiled"]
    other_python = {**entry, "magic": "00000000"}
    damaged = {**entry, "module": entry["module"][:-1] + b"\0"}
    cases = {
        "intact": (entry, False, False),
        "another Python's": (other_python, True, False),
        "damaged": (damaged, True, True),
        "junk": ("junk", True, False),
    }
    for case, (changed, compiles, warned) in cases.items():
        caplog.clear()
        compiled.clear()
        with caplog.at_level(logging.WARNING, logger="torch_precompile"):
            run = precompile.load(code, _repack(code, cache, compiled=changed))
        assert any("compiled module is damaged" in r.message for r in caplog.records) == warned
        assert compiled == ([(bytecode.filename(code), "exec")] if compiles else []), case
        _runs_right(run)
    compiled.clear()
    _runs_right(precompile.load(code, None))
    assert compiled == [(bytecode.filename(code), "exec")]


def test_another_compiled_module_is_refused(backend: str, artifacts) -> None:
    """An intact module the seal does not name: another artifact's, or this one's under an
    edited source (the envelope made for the edit, so only the seal can tell)."""
    code, cache = artifacts.pair(NAME, backend)
    other = _envelope(artifacts.pair("mlp_infer", backend)[1])["compiled"]
    with pytest.raises(PrecompileError, match="compiled module that the seal"):
        precompile.load(code, _repack(code, cache, compiled=other))
    edited = code.replace("\nforward = ", "\nprint('edited')\nforward = ", 1)
    assert edited != code and edited.endswith(code[-120:])
    with pytest.raises(PrecompileError, match="compiled module that the seal"):
        precompile.load(edited, _repack(edited, cache))


def test_tracebacks_show_the_artifact_source(backend: str, artifacts) -> None:
    """Frames run from the cached module still point at the artifact's lines."""
    run = artifacts.load(NAME, backend)
    model, x, t = WORKLOADS[NAME].args()
    with pytest.raises(PrecompileError) as info:
        run(model, x[:, :3], t)
    frames = traceback.extract_tb(info.value.__traceback__)
    artifact_frames = [f for f in frames if f.filename.startswith("<precompiled artifact ")]
    assert artifact_frames and all(f.line for f in artifact_frames)
    assert artifact_frames[0].filename == bytecode.filename(artifacts.pair(NAME, backend)[0])
