"""The inductor cache: a cached load in a fresh process builds nothing; stale bytes rebuild."""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from torch_precompile import PrecompileError, precompile
from torch_precompile.artifact import envelope
from torch_precompile.artifact import kernel_payload as kernels

from conftest import (
    FRESH_LOAD,
    assert_runs_like_eager,
    kernel_payload,
    poisoned_toolchain,
    run_python,
    with_kernel_payload,
    write_pair,
)
from workloads import WORKLOADS


def test_cached_load_runs_no_compiler_and_imports_no_inductor(artifacts, tmp_path) -> None:
    code, cache = artifacts.pair("mlp_train", "inductor")
    paths = write_pair(tmp_path, "mlp_train", code, cache)
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(FRESH_LOAD.format(name="mlp_train", **paths), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"inductor_imported": false, "build_time_modules": []' in proc.stdout
    assert not marker.exists(), marker.read_text()
    assert not any(Path(env["TMPDIR"]).iterdir()), "a cached load wrote to the temp dir"
    assert not any(Path(env["TORCHINDUCTOR_CACHE_DIR"]).iterdir())


def test_poisoned_toolchain_really_fails_without_the_cache(artifacts, tmp_path) -> None:
    """The check above means something: without the cache the same process must build."""
    code, _ = artifacts.pair("mlp_train", "inductor")
    paths = write_pair(tmp_path, "mlp_train", code, b"")
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(FRESH_LOAD.format(name="mlp_train", **paths), env=env)
    assert proc.returncode != 0
    assert marker.exists()


def _repacked(code: str, cache: bytes, edit) -> bytes:
    payload = kernel_payload(code, cache)
    edit(payload)
    return with_kernel_payload(code, payload)


def test_stale_fingerprint_rebuilds_in_a_fresh_process(artifacts, tmp_path) -> None:
    code, cache = artifacts.pair("mlp_infer", "inductor")
    stale = _repacked(code, cache, lambda p: p["fingerprint"].update(torch_git="0" * 40))
    paths = write_pair(tmp_path, "mlp_infer", code, stale)
    cache_dir = tmp_path / "inductor-cache"
    proc = run_python(
        FRESH_LOAD.format(name="mlp_infer", **paths),
        env={"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "built for another machine or torch (torch_git" in proc.stderr
    assert '"inductor_imported": true' in proc.stdout
    assert any(cache_dir.rglob("*.so")), "the fallback should have built kernels"


@pytest.mark.parametrize("damage", ["corrupt-object", "missing-kernel", "unreadable-payload"])
def test_damaged_kernels_fall_back_with_a_warning(damage: str, artifacts, caplog) -> None:
    """Each damage gets a warning that says what is wrong, naming the kernel that will be
    built; the artifact then builds it and computes what eager computes."""
    code, cache = artifacts.pair("mlp_train", "inductor")
    damaged_keys: list[str] = []

    def corrupt(payload) -> None:
        key, entry = next(iter(payload["kernels"].items()))
        damaged_keys.append(key)
        entry["object"] = entry["object"][:100] + b"\0" * 64 + entry["object"][164:]

    def drop(payload) -> None:
        damaged_keys.append(payload["kernels"].popitem()[0])

    if damage == "corrupt-object":
        damaged = _repacked(code, cache, corrupt)
        expected = [f"kernel {damaged_keys[0][:12]}… is unusable", "will be built"]
    elif damage == "missing-kernel":
        damaged = _repacked(code, cache, drop)
        expected = ["lacks 1 kernel object", f"{damaged_keys[0][:12]}…", "will be built"]
    else:
        damaged = envelope.pack("inductor", code, b"not a payload")
        expected = ["kernel payload unreadable", "kernels will be built"]
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = precompile.load(code, damaged)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(all(part in w for part in expected) for w in warnings), warnings
    assert_runs_like_eager(run, "mlp_train")


def test_fingerprint_rules() -> None:
    here = kernels.machine_fingerprint()
    assert kernels.fingerprint_mismatch(here) is None
    fewer_flags = {**here, "cpu_flags": here["cpu_flags"][: len(here["cpu_flags"]) // 2]}
    assert kernels.fingerprint_mismatch(fewer_flags) is None
    assert "lacks imaginary_isa" in kernels.fingerprint_mismatch(
        {**here, "cpu_flags": [*here["cpu_flags"], "imaginary_isa"]}
    )
    assert "python" in kernels.fingerprint_mismatch({**here, "python": [3, 99]})
    assert "machine" in kernels.fingerprint_mismatch({**here, "machine": "sparc"})


def _kernel_calls(source: str) -> list[tuple[Any, ...]]:
    """(argtypes, source, options) of every ``async_compile.cpp_pybinding(...)`` call in an
    artifact, read off its syntax tree."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "cpp_pybinding"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "async_compile"
        ):
            options = sorted((k.arg, repr(ast.literal_eval(k.value))) for k in node.keywords)
            calls.append((*(repr(ast.literal_eval(a)) for a in node.args), *options))
    return calls


SERVED_PREBUILT = """
    import json, sys, torch
    from torch_precompile import precompile
    from workloads import WORKLOADS
    code = open({code!r}).read()
    cache = open({cache!r}, "rb").read()
    sys.modules["torch._inductor"] = None  # a kernel not served prebuilt cannot be built
    run = precompile.load(code, cache)
    torch.testing.assert_close(run(*WORKLOADS[{name!r}].args(1)), torch.load({expected!r}))
    print(json.dumps({{"inductor_imported": "torch._inductor" in sys.modules
                       and sys.modules["torch._inductor"] is not None}}))
"""


def test_cache_holds_every_kernel_of_the_artifact(artifacts, tmp_path) -> None:
    """The artifact's source says which kernels it needs; the cache holds each one, and a
    fresh process with no compiler and no Inductor runs them all from it."""
    code, cache = artifacts.pair("mlp_train", "inductor", wrapper="python")  # kernels apart
    calls = _kernel_calls(code)
    assert calls, "the artifact builds no C++ kernel"
    assert code.count("async_compile.cpp_pybinding(") == len(calls)  # none in another form
    payload = kernel_payload(code, cache)
    held, needed = len(payload["kernels"]), len(set(calls))
    assert held == needed, f"the cache holds {held} kernel objects, the source calls {needed}"
    assert payload["fingerprint"] == kernels.machine_fingerprint()
    paths = write_pair(tmp_path, "mlp_train", code, cache)
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(SERVED_PREBUILT.format(name="mlp_train", **paths), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"inductor_imported": False}
    assert "will be built" not in proc.stderr
    assert not marker.exists(), marker.read_text()


def test_kernels_built_without_the_cache_take_the_width_they_were_written_for(tmp_path) -> None:
    """Kernels generated for 256-bit vectors, built in a fresh process without the cache,
    compute the right result also where this CPU's own vectors are wider."""
    from torch._inductor import config as inductor_config

    from torch_precompile.internals.vector_units import vector_bits

    if vector_bits() < 256:
        pytest.skip("this CPU has no 256-bit vectors")
    workload = WORKLOADS["mlp_infer"]
    with inductor_config.patch({"cpp.simdlen": 256}):
        code, _ = precompile(workload.fn, *workload.args())
    assert "vector_bits=256)" in code
    paths = write_pair(tmp_path, "mlp_infer", code, b"")
    proc = run_python(
        FRESH_LOAD.replace('open({cache!r}, "rb").read()', "None").format(
            name="mlp_infer", **paths
        ),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ic")},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kernels_for_a_width_this_cpu_lacks_are_refused_not_built(artifacts) -> None:
    code, _ = artifacts.pair("mlp_infer", "inductor")
    wider = re.sub(r"vector_bits=\d+\)", "vector_bits=1024)", code)
    assert wider != code
    with pytest.raises(
        PrecompileError,
        match="generated for 1024-bit vectors and this CPU has no vector unit of that width",
    ):
        precompile.load(wider, None)


def test_the_vector_unit_probes_run_side_by_side(monkeypatch) -> None:
    """Each vector unit the CPU names is probed once, each in a thread of its own and at the
    same time as the others; a unit the CPU does not name is never probed."""
    import platform
    import threading
    import time

    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    from torch_precompile.internals.vector_units import probe_vector_units

    probes: list[tuple[str, int, float, float]] = []

    class Unit:
        def __init__(self, flags: str) -> None:
            self.flags = flags

        def __str__(self) -> str:
            return self.flags

        def __bool__(self) -> bool:
            start = time.perf_counter()
            time.sleep(0.3)
            probes.append((self.flags, threading.get_ident(), start, time.perf_counter()))
            return True

    units = [Unit("avx512 avx512_vnni"), Unit("avx512"), Unit("avx2"), Unit("amx_tile")]
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", units)
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512", "avx512_vnni"])
    probe_vector_units.__wrapped__()
    assert sorted(flags for flags, *_ in probes) == ["avx2", "avx512", "avx512 avx512_vnni"]
    assert len({thread for _, thread, _, _ in probes}) == 3
    assert max(start for *_, start, _ in probes) < min(end for *_, end in probes)
