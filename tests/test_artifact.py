"""The artifact as a user meets it: readable source that runs on its own, in a fresh process."""

from __future__ import annotations

import inspect

import pytest
import torch

from torch_precompile import driver
from torch_precompile.spec import SCHEMA_VERSION, SPEC_NAME

from conftest import run_python
from workloads import WORKLOADS

FRESH_CHECK = """
    import copy, torch
    from workloads import WORKLOADS
    expected = torch.load({expected!r}, weights_only=False)
    workload = WORKLOADS[{name!r}]
    args = workload.args()
    code = open({code!r}).read()
    {load}
    result = run(*args)
    def same(a, b):
        import torch.utils._pytree as pytree
        la, sa = pytree.tree_flatten(a); lb, sb = pytree.tree_flatten(b)
        assert sa == sb, (sa, sb)
        for u, v in zip(la, lb):
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5, equal_nan=True)
            else:
                assert u == v
    same(result, expected["result"])
    grads = [None if p.grad is None else p.grad for m in args if isinstance(m, torch.nn.Module)
             for p in m.parameters()]
    same(grads, expected["grads"])
    print("FRESH-OK")
"""

LOADERS = {
    "standalone": 'namespace = {{}}\n    exec(code, namespace)\n    run = namespace["forward"]',
    "load-with-cache": "from torch_precompile import precompile\n    run = precompile.load("
                       "code, open({cache!r}, 'rb').read())",
    "load-without-cache": "from torch_precompile import precompile\n    run = precompile.load("
                          "code, None)",
}


@pytest.mark.parametrize("how", list(LOADERS))
@pytest.mark.parametrize("name", ["mlp_train", "tied", "mask", "literals"])
def test_runs_in_a_fresh_process(name: str, how: str, backend: str, artifacts, tmp_path) -> None:
    code, cache = artifacts.pair(name, backend)
    workload = WORKLOADS[name]
    args = workload.args()
    result = workload.fn(*args)
    grads = [p.grad for m in args if isinstance(m, torch.nn.Module) for p in m.parameters()]
    (tmp_path / "a.py").write_text(code)
    (tmp_path / "a.cache").write_bytes(cache)
    torch.save({"result": result, "grads": grads}, tmp_path / "expected.pt")
    load = LOADERS[how].format(cache=str(tmp_path / "a.cache"))
    script = FRESH_CHECK.format(expected=str(tmp_path / "expected.pt"), name=name,
                                code=str(tmp_path / "a.py"), load=load)
    proc = run_python(script, block_package=how == "standalone")
    assert proc.returncode == 0 and "FRESH-OK" in proc.stdout, proc.stderr[-3000:]


def test_standalone_artifact_imports_nothing_from_the_package(backend: str, artifacts,
                                                              tmp_path) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    assert "torch_precompile import" not in code and "import torch_precompile" not in code
    path = tmp_path / "artifact.py"
    path.write_text(code)
    proc = run_python(f"""
        import runpy
        runpy.run_path({str(path)!r}, run_name="__main__")
        assert "torch_precompile" not in sys.modules or sys.modules["torch_precompile"] is None
    """, block_package=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "call forward(m, x)" in proc.stdout


def test_sections_in_order(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("mlp_train", backend)
    assert code.startswith("# A precompiled PyTorch computation")
    assert "no weights are stored here" in code
    positions = [code.index(f"=\n# {n}. ") for n in (2, 3, 4)]
    assert positions == sorted(positions)
    section = code[positions[1]:positions[2]]
    assert f"\n{SPEC_NAME} = {{'schema_version': {SCHEMA_VERSION}," in section
    assert code.count(f"\n{SPEC_NAME} = ") == 1
    assert code.rstrip().splitlines()[-3:-1] == ["", f"PLAN = Plan({SPEC_NAME}, call)"] or (
        f"\nPLAN = Plan({SPEC_NAME}, call)\n" in code[positions[2]:])
    assert code.index("def call(") < positions[1]


def test_driver_is_the_package_module_verbatim(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    assert inspect.getsource(driver) in code
    assert "from __future__ import" not in inspect.getsource(driver)


def test_eager_graph_bakes_inf_nan_and_device(artifacts) -> None:
    code, _ = artifacts.pair("mask", "eager")
    assert "-inf" in code and " nan" in code and "device(type='cpu')" in code


def test_inductor_section_is_the_python_wrapper_without_benchmark_harness(artifacts) -> None:
    code, _ = artifacts.pair("mlp_train", "inductor")
    assert "def call(self, args)" in code and "assert_size_stride(" in code
    assert "benchmark_compiled_module" not in code and "def get_args" not in code
    # Inductor is imported only lazily (inside functions), never at the module's top level.
    top_level = [line for line in code.splitlines() if line.startswith(("from ", "import "))]
    assert not [line for line in top_level if "torch._inductor" in line]
