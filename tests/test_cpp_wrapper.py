"""wrapper='cpp': Inductor's C++ wrapper, built into the cache beside the kernels.

The artifact holds the wrapper's C++ source (``cpp_wrapper_src``); its shared object is a
cache entry like a kernel's, pinned by the source, loaded without a compiler or Inductor, and
built from the source where the cache cannot serve it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.decorators import mark_unbacked

from torch_precompile import PrecompileError, precompile
from torch_precompile.inspection import describe

from conftest import (
    FRESH_LOAD,
    assert_runs_like_eager,
    assert_same,
    kernel_payload,
    model_state,
    poisoned_toolchain,
    run_eager_and_compiled,
    run_python,
    with_kernel_payload,
    write_pair,
)
from workloads import WORKLOADS

WRAPPER_ENTRY = "inductor_entry_cpp"


def test_inference_runs_in_the_cpp_wrapper_and_says_so(artifacts, tmp_path: Path) -> None:
    code, cache = artifacts.pair("mlp_infer", "inductor", wrapper="cpp")
    assert "\n# Wrapper: C++." in code and "\ncpp_wrapper_src = (" in code
    assert "def call(self, args)" not in code  # no Python wrapper beside it
    modules = {entry["module"] for entry in kernel_payload(code, cache)["kernels"].values()}
    assert modules == {WRAPPER_ENTRY}  # on CPU the kernels are inside the wrapper's object
    precompile.save(code, cache, tmp_path / "a.py")
    assert describe(tmp_path / "a.py")["wrapper"] == "cpp"
    eager, compiled, _, _ = run_eager_and_compiled(
        "mlp_infer", precompile.load(code, cache), calls=2
    )
    assert_same(compiled, eager)


def test_training_matches_eager_over_three_calls(artifacts) -> None:
    code, cache = artifacts.pair("mlp_train", "inductor", wrapper="cpp")
    assert "\n# Wrapper: C++." in code
    run = precompile.load(code, cache)
    eager, compiled, eager_args, compiled_args = run_eager_and_compiled("mlp_train", run, calls=3)
    assert_same(compiled, eager)
    assert_same(model_state(compiled_args[0]), model_state(eager_args[0]))
    assert all(p.grad is not None for p in compiled_args[0].parameters())


@pytest.mark.parametrize("name", ["mlp_infer", "mlp_train"])
def test_the_driver_checks_layouts_so_the_wrapper_does_not(name: str, artifacts) -> None:
    """Every input's layout is the driver's check, so the C++ source asserts none of them
    (each assert costs a string stream per call there); a wrong layout of any input is still
    refused, before anything runs."""
    code, cache = artifacts.pair(name, "inductor", wrapper="cpp")
    source = code[code.index("\ncpp_wrapper_src = (") : code.index("\ninductor_entry = ")]
    assert "inductor_entry_impl" in source and "assert_size_stride(" not in source
    assert "unsafe_alloc_void_ptrs_from_tensors(args)" in code  # no Python walk of the inputs
    run = precompile.load(code, cache)
    assert_runs_like_eager(run, name)
    model, *inputs = WORKLOADS[name].args(1)
    for i, tensor in enumerate(inputs):
        if tensor.dim() < 2 or not tensor.is_floating_point():
            continue
        transposed = tensor.t().contiguous().t()  # same shape and values, other strides
        bad = [transposed if j == i else t for j, t in enumerate(inputs)]
        before = model_state(model)
        with pytest.raises(PrecompileError, match="strides"):
            run(model, *bad)
        assert_same(model_state(model), before)  # refused before anything ran


@pytest.mark.parametrize("name", ["mlp_infer", "mlp_train"])
def test_dynamic_dims(name: str) -> None:
    """A dim of its own (inference) and one shared by inputs (training, shape_id)."""
    workload = WORKLOADS[name]
    model, *inputs = workload.args()
    for tensor in inputs:  # BatchNorm needs a batch of 2 or more
        mark_unbacked(tensor, 0, min=2, **({"shape_id": "batch"} if len(inputs) > 1 else {}))
    code, cache = precompile(workload.fn, model, *inputs, wrapper="cpp")
    assert "\n# Wrapper: C++." in code
    run = precompile.load(code, cache)
    for batch in (3, 9):
        sized = [torch.randn(batch, *t.shape[1:]) for t in inputs]
        eager_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
        assert_same(run(compiled_model, *sized), workload.fn(eager_model, *sized))
        assert_same(model_state(compiled_model), model_state(eager_model))


def test_cached_load_needs_no_compiler_and_no_inductor(artifacts, tmp_path: Path) -> None:
    code, cache = artifacts.pair("mlp_infer", "inductor", wrapper="cpp")
    paths = write_pair(tmp_path, "mlp_infer", code, cache)
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(FRESH_LOAD.format(name="mlp_infer", **paths), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"inductor_imported": false' in proc.stdout
    assert not marker.exists(), marker.read_text()


def test_without_the_cache_the_wrapper_is_built_from_its_source(artifacts, tmp_path: Path) -> None:
    code, _ = artifacts.pair("mlp_infer", "inductor", wrapper="cpp")
    paths = write_pair(tmp_path, "mlp_infer", code, b"")
    proc = run_python(
        FRESH_LOAD.replace('open({cache!r}, "rb").read()', "None").format(
            name="mlp_infer", **paths
        ),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ic")},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"inductor_imported": true' in proc.stdout


def test_a_swapped_wrapper_object_is_refused(artifacts) -> None:
    code, cache = artifacts.pair("mlp_infer", "inductor", wrapper="cpp")
    payload = kernel_payload(code, cache)
    key, entry = next((k, e) for k, e in payload["kernels"].items() if e["module"] == WRAPPER_ENTRY)
    entry["object"] += b"\0"
    entry["sha256"] = hashlib.sha256(entry["object"]).hexdigest()
    with pytest.raises(
        PrecompileError, match=f"kernel {key[:12]}…: sha256 .*python_code names sha256"
    ):
        precompile.load(code, with_kernel_payload(code, payload))


def _built_here(run: Any) -> list[str]:
    """The kernel keys the loaded artifact's kernel loader built in this process (those its
    cache did not provide), as the loader records them."""
    return run._forward.call.__globals__["CppWrapperCodeCache"].built_here


def test_a_damaged_wrapper_object_is_rebuilt_with_a_warning(artifacts, caplog) -> None:
    """The damaged object is not mapped: the warning names it and says it will be built, the
    artifact's loader builds exactly it from the source (an intact cache builds nothing), and
    the rebuilt wrapper computes what eager does."""
    code, cache = artifacts.pair("mlp_infer", "inductor", wrapper="cpp")
    assert _built_here(precompile.load(code, cache)) == []
    payload = kernel_payload(code, cache)
    key, entry = next((k, e) for k, e in payload["kernels"].items() if e["module"] == WRAPPER_ENTRY)
    middle = len(entry["object"]) // 2
    entry["object"] = entry["object"][:middle] + b"\xff" + entry["object"][middle + 1 :]
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = precompile.load(code, with_kernel_payload(code, payload))
    assert (
        f"kernel {key[:12]}… is unusable (its bytes are damaged: they do not match their "
        "checksum); it will be built from python_code on first use." in caplog.text
    )
    eager, compiled, _, _ = run_eager_and_compiled("mlp_infer", run)
    assert _built_here(run) == [key]
    assert_same(compiled, eager)


def test_wrapper_values_refused_by_name() -> None:
    workload = WORKLOADS["mlp_infer"]
    with pytest.raises(
        PrecompileError, match=r"wrapper must be one of \('auto', 'cpp', 'python'\)"
    ):
        precompile(workload.fn, *workload.args(), wrapper="rust")
    with pytest.raises(PrecompileError, match="backend='eager' has none"):
        precompile(workload.fn, *workload.args(), backend="eager", wrapper="cpp")


_DTENSOR_FALLBACK = """
    import datetime, json, logging, socket, torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_precompile import precompile
    logging.basicConfig(level=logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh,
                                                        [Shard(0)]))
    model.bias = torch.nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Shard(0)]))
    x = distribute_tensor(torch.randn(2, 4), mesh, [Shard(0)])
    code, cache = precompile(lambda m, x: m(x).sum(), model, x, wrapper="cpp")
    run = precompile.load(code, cache)
    torch.testing.assert_close(run(model, x), model(x).sum())
    default, _ = precompile(lambda m, x: m(x).sum(), model, x)
    print(json.dumps([line for text in (code, default) for line in text.splitlines()
                      if line.startswith("# Wrapper: ")]))
    dist.destroy_process_group()
"""


def test_a_graph_that_communicates_falls_back_to_the_python_wrapper() -> None:
    proc = run_python(_DTENSOR_FALLBACK, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Asked for, the C++ wrapper's absence is a warning; by default it is only said in the source.
    assert (
        proc.stderr.count("wrapper='cpp' cannot be used for this graph (the graph communicates")
        == 1
    )
    asked, by_default = json.loads(proc.stdout.strip().splitlines()[-1])
    assert asked.startswith(
        "# Wrapper: Python. wrapper='cpp' was asked for and cannot be used: the graph communicates"
    )
    assert by_default.startswith(
        "# Wrapper: Python. the C++ wrapper is not used: the graph communicates"
    )


def test_the_default_is_the_cpp_wrapper_and_python_stays_on_request(artifacts) -> None:
    default, _ = artifacts.pair("mlp_infer", "inductor")
    assert "\n# Wrapper: C++." in default
    code, cache = precompile(
        WORKLOADS["mlp_infer"].fn, *WORKLOADS["mlp_infer"].args(), wrapper="python"
    )
    assert "# Wrapper: " not in code and "def call(self, args)" in code
    model, x = WORKLOADS["mlp_infer"].args()
    assert_same(precompile.load(code, cache)(model, x), WORKLOADS["mlp_infer"].fn(model, x))


def test_a_failed_cpp_build_falls_back_by_default_and_is_refused_on_request(monkeypatch) -> None:
    """Where the C++ wrapper's build fails, the default takes the Python wrapper and says why;
    asked for explicitly, the failure is a PrecompileError, never torch's own exception."""
    import torch_precompile.lower.inductor as lowering
    from torch_precompile.internals.inductor import is_cpp_wrapper

    real = lowering.collect_built_kernels

    def failing_for_cpp(wrapper: str) -> Any:
        if is_cpp_wrapper(wrapper):
            raise RuntimeError("C++ compile failed (simulated)\nerror: line 2 of the log")
        return real(wrapper)

    monkeypatch.setattr(lowering, "collect_built_kernels", failing_for_cpp)
    workload = WORKLOADS["mlp_infer"]
    code, cache = precompile(workload.fn, *workload.args())
    assert (
        "\n# Wrapper: Python. the C++ wrapper is not used: RuntimeError: C++ compile "
        "failed (simulated)."
    ) in code
    assert "line 2 of the log" not in code  # the reason is one comment line
    model, x = workload.args()
    assert_same(precompile.load(code, cache)(model, x), workload.fn(model, x))
    with pytest.raises(PrecompileError, match="C[+][+] wrapper could not be built .*simulated"):
        precompile(workload.fn, *workload.args(), wrapper="cpp")


def test_the_wrapper_is_built_once_as_glue_and_kernels(monkeypatch) -> None:
    """The glue (-O1) and the kernels (-O3) are compiled once each, then linked. Before:
    Inductor built the wrapper as one unit at -O3 and the package built it again without the
    input asserts, so a 24-block training step took over 11 minutes."""
    from torch._inductor import cpp_builder

    commands: list[str] = []
    real = cpp_builder.run_compile_cmd

    def counted(cmd_line: str, cwd: str) -> None:
        commands.append(cmd_line)
        real(cmd_line, cwd)

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", counted)
    scale = 1.0 + uuid.uuid4().int % 10**6 / 10**7  # no earlier build, cached, shares it

    def fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(model(x) * scale)

    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with torch.no_grad():  # one graph: no forward and backward beside it
        code, cache = precompile(fn, model, x, wrapper="cpp")
    assert "\nkernel_src = (" in code and "kernel_code=kernel_src" in code
    glue = [c for c in commands if ".main.cpp" in c]
    kernels = [c for c in commands if ".optimized.cpp" in c]
    assert len(glue) == 1 and len(kernels) == 1, commands
    assert " -O1" in glue[0] and " -O3" in kernels[0]
    assert_same(precompile.load(code, cache)(model, x), fn(model, x))
