"""The artifact as a user meets it: readable source that runs on its own, in a fresh process."""

from __future__ import annotations

import ast
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torch_precompile
from torch_precompile import PrecompileError, precompile
from torch_precompile.lower.inductor import GENERATED_END, GENERATED_START
from torch_precompile.shipped.driver import (
    call_state,
    core,
    distributed,
    dynamic,
    hook_values,
    memo,
    module_rules,
    plain,
    rechecks,
    tensor_rules,
    values,
)
from torch_precompile.shipped.source import defined_names, shipped_source
from torch_precompile.spec import SCHEMA_VERSION, SPEC_NAME

from conftest import run_python
from workloads import WORKLOADS

# How the artifacts name the workloads' file: relative to the directory the tests run in.
WORKLOADS_FILE = os.path.relpath(inspect.getsourcefile(WORKLOADS["mlp_infer"].fn))

# One fresh process per backend and way of loading runs every workload's artifact in turn
# (new weights and inputs, not the capture's example) and says for each whether it matched.
FRESH_CHECK = """
    import json, traceback, torch
    import torch.utils._pytree as pytree
    from workloads import WORKLOADS

    def same(a, b):
        la, sa = pytree.tree_flatten(a); lb, sb = pytree.tree_flatten(b)
        assert sa == sb, (sa, sb)
        for u, v in zip(la, lb):
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5, equal_nan=True)
            else:
                assert u == v

    def check(name, code_path, cache_path, expected_path):
        expected = torch.load(expected_path, weights_only=False)
        args = WORKLOADS[name].args(1)
        code = open(code_path).read()
        {load}
        same(run(*args), expected["result"])
        modules = [m for m in args if isinstance(m, torch.nn.Module)]
        same([p.grad for m in modules for p in m.parameters()], expected["grads"])

    for name, code_path, cache_path, expected_path in {cases!r}:
        try:
            check(name, code_path, cache_path, expected_path)
            print("FRESH", json.dumps([name, "ok"]))
        except Exception:
            print("FRESH", json.dumps([name, traceback.format_exc()[-3000:]]))
"""

LOADERS = {
    "standalone": "namespace = {}\n        exec(code, namespace)\n        "
    'run = namespace["forward"]',
    "load-with-cache": "from torch_precompile import precompile\n        "
    "run = precompile.load(code, open(cache_path, 'rb').read())",
    "load-without-cache": "from torch_precompile import precompile\n        "
    "run = precompile.load(code, None)",
}


@pytest.fixture(scope="module")
def fresh_runs(request, artifacts, tmp_path_factory) -> Callable[[str, str, str], str]:
    """``fresh(name, how, backend)``: "ok", or how the workload's artifact failed in a fresh
    process; the process runs every workload this session's tests ask of that backend and
    loader at once."""
    wanted = collections.defaultdict(list)
    for item in request.session.items:
        if getattr(item, "originalname", None) != "test_runs_in_a_fresh_process":
            continue
        params = item.callspec.params
        wanted[params["how"], params["backend"]].append(params["name"])
    said: dict[tuple[str, str], dict[str, str]] = {}

    def fresh(name: str, how: str, backend: str) -> str:
        if (how, backend) not in said:
            folder = tmp_path_factory.mktemp(f"{how}-{backend}")
            cases = [_fresh_case(n, backend, artifacts, folder) for n in wanted[how, backend]]
            script = FRESH_CHECK.format(load=LOADERS[how], cases=cases)
            proc = run_python(script, block_package=how == "standalone")
            assert proc.returncode == 0, proc.stderr[-3000:]
            lines = [
                line.split(" ", 1)[1]
                for line in proc.stdout.splitlines()
                if line.startswith("FRESH ")
            ]
            said[how, backend] = dict(json.loads(line) for line in lines)
        return said[how, backend].get(name, "not run")

    return fresh


def _fresh_case(name: str, backend: str, artifacts, folder: Path) -> tuple[str, ...]:
    """The files a fresh process checks a workload with: its pair and eager's results."""
    code, cache = artifacts.pair(name, backend)
    args = WORKLOADS[name].args(1)  # the same new weights and inputs the process makes
    result = WORKLOADS[name].fn(*args)
    grads = [p.grad for m in args if isinstance(m, torch.nn.Module) for p in m.parameters()]
    paths = [folder / f"{name}.py", folder / f"{name}.cache", folder / f"{name}.expected.pt"]
    paths[0].write_text(code)
    paths[1].write_bytes(cache)
    torch.save({"result": result, "grads": grads}, paths[2])
    return (name, *map(str, paths))


# Ties, masks, literals and pytrees are the package's own spec; a fresh process on a newer
# torch release is tested with mlp_train in every loader (see default_release in conftest).
@pytest.mark.parametrize("how", list(LOADERS))
@pytest.mark.parametrize(
    "name",
    [
        "mlp_train",
        *(
            pytest.param(n, marks=pytest.mark.default_release)
            for n in ("tied", "mask", "literals", "pytree")
        ),
    ],
)
def test_runs_in_a_fresh_process(name: str, how: str, backend: str, fresh_runs) -> None:
    assert fresh_runs(name, how, backend) == "ok"


def test_standalone_artifact_imports_nothing_from_the_package(
    backend: str, artifacts, tmp_path
) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    assert "torch_precompile import" not in code and "import torch_precompile" not in code
    path = tmp_path / "artifact.py"
    path.write_text(code)
    proc = run_python(
        f"""
        import runpy
        runpy.run_path({str(path)!r}, run_name="__main__")
        assert "torch_precompile" not in sys.modules or sys.modules["torch_precompile"] is None
    """,
        block_package=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "call forward(m, x)" in proc.stdout


def test_sections_in_order(backend: str, artifacts) -> None:
    """Meaning first: what it is and how to call it, the spec, the graph, then the driver."""
    code, _ = artifacts.pair("mlp_train", backend)
    first = " ".join(line.removeprefix("# ") for line in code.split("\n#\n")[0].splitlines())
    assert first.startswith(
        "A precompiled PyTorch computation: forward(m, x, t), captured from "
        f"mse_step ({WORKLOADS_FILE}, line "
    )
    assert "No weights are inside" in code[:2000]
    positions = [code.index(f"=\n# {n}. ") for n in (1, 2, 3)]
    assert positions == sorted(positions)
    spec_section = code[positions[0] : positions[1]]
    assert f"\n{SPEC_NAME} = {{\n    'schema_version': {SCHEMA_VERSION},\n" in spec_section
    assert code.count(f"\n{SPEC_NAME} = ") == 1
    assert positions[1] < code.index("\ndef call(") < positions[2]
    driver = code[positions[2] :]
    if "class Driver:" not in driver:  # a plain artifact: its generated checks, then the runtime
        assert driver.index("def check_call(") < driver.index("def check_models(")
        assert driver.index("def check_models(") < driver.index("class PlainForward:")
        assert driver.rstrip().splitlines()[-1].startswith("# sha256 ")
        assert "\nforward = PlainForward(\n    call,\n    check_call," in driver
        return
    assert (
        driver.index("class Driver:")
        < driver.index("def check_arguments(")
        < driver.index("def walk_models(")
        < driver.index("class ModelMemo:")
    )
    # The MLP's ReLU and BatchNorm read their options (inplace, momentum, eps): Python values.
    binding = f"forward = Driver({SPEC_NAME}, call, check_call, facts=PythonFacts, memo=ModelMemo)"
    statements = [line for line in driver.splitlines() if line and not line.startswith("#")]
    assert statements[-3] == binding


def test_a_calls_checks_are_generated_for_what_the_spec_holds(artifacts) -> None:
    """One line per check, in the order they run, and none for a feature the spec lacks: in a
    plain artifact (one model) and in the generic driver's (two models)."""
    code, _ = artifacts.pair("mlp_train", "eager")
    checks = code[code.index("\ndef check_call(") : code.index("\ndef check_models(")]
    lines = [line.strip() for line in checks.splitlines()]
    order = [
        "AMBIENT.check()",
        "raise grad_mode_error()",
        "raise arguments_error(kwargs, len(args), 3, 'm (model), x (input), t (input)')",
        "positional_inputs(inputs, INPUTS)",
        "inputs[0] = check_input(INPUTS[0], inputs[0], 'eager')  # x: float32[5, 4]",
        "inputs[1] = check_input(INPUTS[1], inputs[1], 'eager')  # t: float32[5, 3]",
        "flat = [*REMEMBERED.model_tensors([args[0]]), *inputs]",
        "check_written_apart(flat, APART, WRITTEN, FLAT_NAMES.__getitem__, PARAMETERS)",  # BN's
    ]
    _in_order(lines, order)
    for absent in ("OPTIMIZERS", "driver.", "GLOBALS"):
        assert absent not in checks
    code, _ = artifacts.pair("two_models", "eager")
    checks = code[code.index("\ndef check_call(") : code.index("    return state, inputs, ()")]
    lines = [line.strip() for line in checks.splitlines()]
    order = [
        "driver.ambient.check()",
        "raise grad_mode_error()",
        "check_arguments(driver, args, kwargs)",
        "leaves = positional_leaves(driver, args)",
        "inputs = checked_inputs(driver, leaves)",
        "state = model_tensors(driver, [args[0], args[2]])",
    ]
    _in_order(lines, order)
    for absent in ("driver.values", "driver.optimizers", "driver.data_parallel"):
        assert absent not in checks
    code, _ = artifacts.pair("pytree", "eager")
    assert "leaves = driver.values.input_leaves(args)" in code
    assert "raise grad_mode_error()" not in code


def _in_order(lines: list[str], order: list[str]) -> None:
    """Each of ``order`` begins a line of ``lines``, in that order."""
    found = [next(i for i, line in enumerate(lines) if line.startswith(o)) for o in order]
    assert found == sorted(found), lines


def test_a_refused_call_fails_in_the_generated_checks(artifacts) -> None:
    run = precompile.load(*artifacts.pair("mlp_infer", "eager"))
    model, _ = WORKLOADS["mlp_infer"].args()
    with pytest.raises(PrecompileError) as refused:
        run(model, torch.randn(5, 7))
    frames = [frame.name for frame in traceback.extract_tb(refused.value.__traceback__)]
    assert "check_call" in frames and refused.value.check_stage == 2


def test_header_says_how_the_artifact_was_made(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    header = code[: code.index("# 1. ")]
    flat = " ".join(line.removeprefix("# ") for line in header.splitlines())
    assert f"Made by torch-precompile {torch_precompile.__version__} on " in flat
    assert f"with tracer make_fx and backend {backend!r}, for torch {torch.__version__}" in flat
    assert re.search(r" on \d{4}-\d\d-\d\d with tracer", flat)
    assert all(len(line) <= 100 for line in header.splitlines())
    writes = "A tensor the graph writes in place (an input or a buffer) must share no memory"
    assert writes not in flat  # inference in eval mode writes nothing
    trained, _ = artifacts.pair("mlp_train", backend)  # BatchNorm writes its statistics
    assert writes in " ".join(line.removeprefix("# ") for line in trained[:4000].splitlines())
    line = inspect.getsourcelines(WORKLOADS["mlp_infer"].fn)[1]
    assert f"captured from infer ({WORKLOADS_FILE}, line {line}) with x float32[5, 4]." in flat
    served, _ = artifacts.pair("mlp_infer", backend, inference=True)
    flat = " ".join(line.removeprefix("# ") for line in served[: 200 * 8].splitlines())
    assert (
        "with x float32[5, 4]. Its results carry no autograd history because it was "
        "precompiled under torch.no_grad()."
    ) in flat


def test_no_absolute_path_of_the_build_machine(backend: str, artifacts) -> None:
    """Provenance names files as the user knows them: relative to where it was built."""
    code, _ = artifacts.pair("mlp_train", backend)
    assert str(Path(__file__).parent) not in code and str(Path.cwd()) not in code
    if backend == "eager":
        assert f"# File: {WORKLOADS_FILE}:" in code


def test_driver_parts_are_the_package_modules_verbatim(backend: str, artifacts) -> None:
    """Each part this artifact needs is copied in, its body to the letter; no other part."""
    plain_code, _ = artifacts.pair("mlp_infer", backend)  # a plain artifact
    generic_code, _ = artifacts.pair("pytree", backend)  # nested inputs: the generic driver
    for code, shipped, absent in (
        (
            plain_code,
            (tensor_rules, call_state, module_rules, rechecks, plain),
            (core, memo, values, dynamic, hook_values),
        ),
        (
            generic_code,
            (tensor_rules, call_state, module_rules, rechecks, core, memo, values),
            (plain, dynamic, distributed),
        ),
    ):
        for module in shipped:
            _definitions_verbatim_or_absent(shipped_source(module).body, code, module.__name__)
            assert "from __future__ import" not in inspect.getsource(module)
        for module in absent:
            assert shipped_source(module).body.splitlines()[0] not in code, module.__name__
        assert "from torch_precompile" not in code and '"""The driver' not in code
        assert "# fmt: off" not in code  # the formatter's directives stay in the package


def _definitions_verbatim_or_absent(body: str, code: str, module: str) -> None:
    """Each top-level definition of a shipped module is in ``code`` to the letter, or not at
    all (the artifact's code never reaches it); its main ones are there."""
    kept = 0
    for statement in ast.parse(body).body:
        names = defined_names(statement)
        text = ast.get_source_segment(body, statement)
        assert text is not None
        if text in code:
            kept += 1
            continue
        for name in names:
            assert not re.search(rf"\b{re.escape(name)}\b", code), (module, name)
    assert kept, module


def test_parts_come_with_the_spec_that_needs_them(artifacts) -> None:
    code, _ = artifacts.pair("pytree", "eager")  # nested inputs with Python values
    assert "class InputValues:" in code and "values=InputValues" in code


def test_the_hook_values_part_comes_with_hooks() -> None:
    """Only a capture with hooks compares the values they hold; without, any hook at a call
    is one too many, whatever it holds."""
    model = torch.nn.Linear(4, 4)
    plain, _ = precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend="eager")
    model.register_forward_hook(lambda m, args, out: out * 2)
    hooked, _ = precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend="eager")
    first_line = shipped_source(hook_values).body.splitlines()[0]
    assert first_line not in plain and "hooks=hook_values" not in plain
    assert first_line in hooked and "hooks=hook_values" in hooked


def test_artifact_has_no_unused_imports(backend: str, artifacts, tmp_path) -> None:
    """Inductor's generated wrapper imports what it may use; everything around it imports
    only what it uses."""
    code, _ = artifacts.pair("mlp_infer", backend)
    if backend == "inductor":
        lines = code.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(GENERATED_START))
        end = lines.index(GENERATED_END)
        code = "\n".join([*lines[:start], "inductor_call = None", *lines[end + 1 :]])
    path = tmp_path / "artifact.py"
    path.write_text(code)
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [str(ruff), "check", "--isolated", "--select", "F401,F811", str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_eager_graph_bakes_inf_nan_and_device(artifacts) -> None:
    """The graph holds -inf, nan and the device as literals, and the artifact computes with
    them as eager does, on eager's device: -inf empties the entries the causal mask hides, nan
    the rows a score over 10 reaches."""
    code, cache = artifacts.pair("mask", "eager")
    assert "-inf" in code and " nan" in code and "device(type='cpu')" in code
    run = precompile.load(code, cache)
    model, x = WORKLOADS["mask"].args()
    large = x.clone()
    large[1] *= 100  # scores over 10: the nan branch, for that batch only
    for given in (x, large):
        expected, got = WORKLOADS["mask"].fn(model, given), run(model, given)
        assert got.device == expected.device
        torch.testing.assert_close(got, expected, equal_nan=True)
        # Eager's own result shows each literal at work: -inf empties what the causal mask
        # hides (exact zeros after softmax), nan the rows it reaches (zeros after nan_to_num).
        assert (expected.triu(1) == 0).all() and (expected.tril() != 0).any()
    assert (expected[1] == 0).all() and (expected[0].diagonal() != 0).all()


@pytest.mark.parametrize("wrapper", ["python", "auto"])
def test_inductor_section_is_the_wrapper_without_benchmark_harness(artifacts, wrapper: str) -> None:
    code, _ = artifacts.pair("mlp_train", "inductor", wrapper=wrapper)
    assert ("def call(self, args)" in code) == (wrapper == "python")
    assert ("\ncpp_wrapper_src = (" in code) == (wrapper == "auto")
    assert "benchmark_compiled_module" not in code and "def get_args" not in code
    # Inductor is imported only lazily (inside functions), never at the module's top level.
    top_level = [line for line in code.splitlines() if line.startswith(("from ", "import "))]
    assert not [line for line in top_level if "torch._inductor" in line]
