"""The inductor cache: a cached load in a fresh process builds nothing; stale bytes rebuild."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import pytest
import torch

from torch_precompile import precompile
from torch_precompile.artifact import envelope
from torch_precompile.artifact import kernel_payload as kernels
from torch_precompile.internals.inductor import cpp_kernel_calls

from conftest import assert_same, run_python
from workloads import WORKLOADS

COMPILERS = ["gcc", "g++", "cc", "c++", "clang", "clang++"]

FRESH_LOAD = """
    import json, os, sys, torch
    from torch_precompile import precompile
    from workloads import WORKLOADS
    code = open({code!r}).read()
    cache = open({cache!r}, "rb").read()
    run = precompile.load(code, cache)
    args = WORKLOADS[{name!r}].args()
    result = run(*args)
    expected = torch.load({expected!r})
    torch.testing.assert_close(result, expected)
    build_time = [name for name in sys.modules if name.startswith((
        "torch_precompile.capture", "torch_precompile.lower", "torch_precompile.internals.tracing",
        "torch_precompile.internals.inductor"))]
    print(json.dumps({{"inductor_imported": "torch._inductor" in sys.modules,
                      "build_time_modules": build_time}}))
"""


def _poisoned_toolchain(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """PATH and CXX pointing at compilers that record being called and fail."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "compiler-was-called"
    for name in COMPILERS:
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho \"$0 $@\" >> {marker}\nexit 1\n")
        tool.chmod(0o755)
    cache_dir, tmp_dir = tmp_path / "inductor-cache", tmp_path / "tmp"
    cache_dir.mkdir()
    tmp_dir.mkdir()
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "CXX": str(bin_dir / "g++"),
        "CC": str(bin_dir / "gcc"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TMPDIR": str(tmp_dir),
    }
    return env, marker


def _write_pair(tmp_path: Path, name: str, code: str, cache: bytes) -> dict[str, str]:
    workload = WORKLOADS[name]
    expected = workload.fn(*workload.args())
    paths = {"code": tmp_path / "a.py", "cache": tmp_path / "a.cache",
             "expected": tmp_path / "expected.pt"}
    paths["code"].write_text(code)
    paths["cache"].write_bytes(cache)
    torch.save(expected, paths["expected"])
    return {k: str(v) for k, v in paths.items()}


def test_cached_load_runs_no_compiler_and_imports_no_inductor(artifacts, tmp_path) -> None:
    code, cache = artifacts.pair("mlp_train", "inductor")
    paths = _write_pair(tmp_path, "mlp_train", code, cache)
    env, marker = _poisoned_toolchain(tmp_path)
    proc = run_python(FRESH_LOAD.format(name="mlp_train", **paths), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"inductor_imported": false, "build_time_modules": []' in proc.stdout
    assert not marker.exists(), marker.read_text()
    assert not any(Path(env["TMPDIR"]).iterdir()), "a cached load wrote to the temp dir"
    assert not any(Path(env["TORCHINDUCTOR_CACHE_DIR"]).iterdir())


def test_poisoned_toolchain_really_fails_without_the_cache(artifacts, tmp_path) -> None:
    """The check above means something: without the cache the same process must build."""
    code, _ = artifacts.pair("mlp_train", "inductor")
    paths = _write_pair(tmp_path, "mlp_train", code, b"")
    env, marker = _poisoned_toolchain(tmp_path)
    proc = run_python(FRESH_LOAD.format(name="mlp_train", **paths), env=env)
    assert proc.returncode != 0
    assert marker.exists()


def _repacked(code: str, cache: bytes, edit) -> bytes:
    acceleration = envelope.unpack(cache, "inductor", code)
    payload = torch.load(io.BytesIO(acceleration), weights_only=True)
    edit(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return envelope.pack("inductor", code, buffer.getvalue())


def test_stale_fingerprint_rebuilds_in_a_fresh_process(artifacts, tmp_path) -> None:
    code, cache = artifacts.pair("mlp_infer", "inductor")
    stale = _repacked(code, cache, lambda p: p["fingerprint"].update(torch_git="0" * 40))
    paths = _write_pair(tmp_path, "mlp_infer", code, stale)
    cache_dir = tmp_path / "inductor-cache"
    proc = run_python(FRESH_LOAD.format(name="mlp_infer", **paths),
                      env={"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "built for another machine or torch (torch_git" in proc.stderr
    assert '"inductor_imported": true' in proc.stdout
    assert any(cache_dir.rglob("*.so")), "the fallback should have built kernels"


@pytest.mark.parametrize("damage", ["corrupt-object", "missing-kernel", "unreadable-payload"])
def test_damaged_kernels_fall_back_with_a_warning(damage: str, artifacts, caplog) -> None:
    code, cache = artifacts.pair("mlp_train", "inductor")

    def corrupt(payload) -> None:
        entry = next(iter(payload["kernels"].values()))
        entry["object"] = entry["object"][:100] + b"\0" * 64 + entry["object"][164:]

    if damage == "corrupt-object":
        damaged, expected_message = _repacked(code, cache, corrupt), "is unusable"
    elif damage == "missing-kernel":
        damaged = _repacked(code, cache, lambda p: p["kernels"].popitem())
        expected_message = None
    else:
        damaged = envelope.pack("inductor", code, b"not a payload")
        expected_message = "kernel payload unreadable"
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = precompile.load(code, damaged)
    if expected_message:
        assert any(expected_message in r.message for r in caplog.records)
    workload = WORKLOADS["mlp_train"]
    assert_same(run(*workload.args()), workload.fn(*workload.args()))


def test_fingerprint_rules() -> None:
    here = kernels.machine_fingerprint()
    assert kernels.fingerprint_mismatch(here) is None
    fewer_flags = {**here, "cpu_flags": here["cpu_flags"][: len(here["cpu_flags"]) // 2]}
    assert kernels.fingerprint_mismatch(fewer_flags) is None
    assert "lacks imaginary_isa" in kernels.fingerprint_mismatch(
        {**here, "cpu_flags": [*here["cpu_flags"], "imaginary_isa"]})
    assert "python" in kernels.fingerprint_mismatch({**here, "python": [3, 99]})
    assert "machine" in kernels.fingerprint_mismatch({**here, "machine": "sparc"})


def test_cache_holds_every_kernel_of_the_artifact(artifacts) -> None:
    code, cache = artifacts.pair("mlp_train", "inductor")
    payload = torch.load(io.BytesIO(envelope.unpack(cache, "inductor", code)), weights_only=True)
    calls = cpp_kernel_calls(code)
    assert calls and len(payload["kernels"]) == len(calls)
    assert payload["fingerprint"] == kernels.machine_fingerprint()
