"""Several calls, one artifact: each kind of call a capture block takes becomes a variant.

A call the artifact built so far does not fit (another batch size, Python value or module
mode) is traced and added; a loaded artifact runs the variant a call fits and refuses one that
fits none, naming the variants. Variants share the kernels Inductor emits for both.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torch_precompile import PrecompileError, capture, precompile
from torch_precompile.artifact import envelope
from torch_precompile.artifact.kernel_payload import read_payload
from torch_precompile.inspection import describe, render
from torch_precompile.spec import ArtifactSpec, from_literal, parse_spec, to_literal

from conftest import assert_same, model_state, poisoned_toolchain, run_python
from workloads import WORKLOADS

NAME = "mlp_train"  # a training step of an MLP with BatchNorm (train and eval differ)


def _kinds() -> list[tuple[str, int, bool]]:
    """(label, batch, training) of each kind of call the fixture captures."""
    return [("batch 5, training", 5, True), ("batch 8, eval", 8, False)]


def _call(batch: int, training: bool, seed: int) -> tuple:
    torch.manual_seed(seed)
    model, _, _ = WORKLOADS[NAME].args()
    return model.train(training), torch.randn(batch, 4), torch.randn(batch, 3)


def _check_against_eager(run, batch: int, training: bool, seed: int) -> None:
    args = _call(batch, training, seed)
    eager_args = (copy.deepcopy(args[0]), *args[1:])
    assert_same(run(*args), WORKLOADS[NAME].fn(*eager_args))
    assert_same(model_state(args[0]), model_state(eager_args[0]))  # .grad and BN stats


@pytest.fixture(scope="module")
def variants_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One inductor capture of two kinds of training step, the first kind called twice."""
    path = tmp_path_factory.mktemp("variants") / "step.py"
    with capture(WORKLOADS[NAME].fn, artifact_path=path) as cap:
        for seed, (_, batch, training) in enumerate([*_kinds(), _kinds()[0]]):
            _check_against_eager(cap, batch, training, seed)  # each call runs for real
    assert len(cap._variants) == 2  # the repeated kind ran its variant
    return path


def test_each_kind_of_call_is_a_variant_of_one_artifact(variants_pair: Path) -> None:
    code = variants_pair.read_text()
    spec = parse_spec(code)
    shapes = [(v.inputs[0].shape, v.submodules[0].training) for v in spec.all_variants]
    assert shapes == [((b, 4), t) for _, b, t in _kinds()]
    assert all(v.kernels == spec.kernels for v in spec.variants)  # held once, for all
    assert code.count("\ndef graph_") == 2 and "\nforward = Variants([\n" in code
    report = describe(variants_pair)
    assert report["variants"] == ["x (5, 4), t (5, 3), training", "x (8, 4), t (8, 3), eval"]
    assert "  variant 2 : x (8, 4), t (8, 3), eval" in render(report)


def test_variants_share_the_kernels_inductor_emits_for_both(tmp_path: Path) -> None:
    def fn(model, x, scale):  # the first layer's kernel does not depend on scale
        return model[1](torch.relu(model[0](x))) * scale

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), torch.randn(3, 4)
    # The Python wrapper's kernels are objects of their own, which variants share; the C++
    # wrapper's object holds the kernels of its graph.
    with torch.no_grad(), capture(fn, artifact_path=tmp_path / "a.py", wrapper="python") as cap:
        for scale in (2.0, 3.0):
            assert_same(cap(model, x, scale), fn(model, x, scale))
    code = (tmp_path / "a.py").read_text()
    cache = envelope.unpack(next(tmp_path.glob("*.cache")).read_bytes(), "inductor", code)
    kernels = read_payload(cache)["kernels"]
    defined = code.count("= async_compile.cpp_pybinding(")
    assert len(kernels) == len(parse_spec(code).kernels) == defined - 1  # the shared one once
    run = precompile.load(tmp_path / "a.py")
    for scale in (3.0, 2.0):
        assert_same(run(model, x, scale), fn(model, x, scale))


def test_a_fresh_process_runs_each_variant_without_a_compiler(
    variants_pair: Path, tmp_path: Path
) -> None:
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(
        _FRESH_SCRIPT.format(path=str(variants_pair), cache=True), env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"inductor_imported": False, "refused": True}
    assert not marker.exists(), marker.read_text()


def test_without_the_cache_each_variant_builds_its_kernels(
    variants_pair: Path, tmp_path: Path
) -> None:
    proc = run_python(
        _FRESH_SCRIPT.format(path=str(variants_pair), cache=False),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ic")},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["inductor_imported"] is True


_FRESH_SCRIPT = """
    import json, sys, torch
    from torch_precompile import PrecompileError, precompile
    from test_variants import _check_against_eager, _kinds
    path = {path!r}
    run = precompile.load(path) if {cache} else precompile.load(open(path).read(), None)
    for seed, (_, batch, training) in enumerate([*_kinds()[::-1], *_kinds()]):
        _check_against_eager(run, batch, training, 10 + seed)
    try:
        _check_against_eager(run, 6, True, 0)
        refused = False
    except PrecompileError:
        refused = True
    print(json.dumps({{"inductor_imported": "torch._inductor" in sys.modules,
                      "refused": refused}}))
"""


def test_a_call_that_fits_no_variant_names_them_all_and_the_nearest(variants_pair) -> None:
    run = precompile.load(variants_pair)
    model, x, t = _call(6, False, 0)
    with pytest.raises(PrecompileError) as refused:
        run(model, x, t)
    message = str(refused.value)
    assert message.startswith(
        "this call fits none of the artifact's 2 variants (1: x (5, 4), "
        "t (5, 3), training; 2: x (8, 4), t (8, 3), eval)"
    )
    assert (
        "Nearest is variant 1 (closest input shapes): input x: expected shape (5, 4), got (6, 4)"
    ) in message
    model, x, t = _call(8, True, 0)  # the shape of variant 2, the mode of variant 1
    with pytest.raises(
        PrecompileError,
        match=r"Nearest is variant 2 \(closest input shapes\): "
        "the model is in training mode",
    ):
        run(model, x, t)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


def test_python_values_and_structures_make_variants(tmp_path: Path, backend: str) -> None:
    def fn(model, x, scale, extra):
        out = model(x) * scale
        return out + extra["bias"] if extra else out

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    calls = [
        (torch.randn(3, 4), 2.0, {}),
        (torch.randn(3, 4), 3.0, {}),
        (torch.randn(3, 4), 2.0, {"bias": torch.randn(2)}),
    ]
    with capture(fn, artifact_path=tmp_path / "a.py", backend=backend) as cap:
        for x, scale, extra in calls:
            assert_same(cap(model, x, scale, extra), fn(model, x, scale, extra))
    run = precompile.load(tmp_path / "a.py")
    for x, scale, extra in [*calls, *calls[::-1]]:
        assert_same(run(model, x, scale, extra), fn(model, x, scale, extra))
    labels = describe(tmp_path / "a.py")["variants"]
    assert labels[:2] == ["x (3, 4), scale=2.0, training", "x (3, 4), scale=3.0, training"]
    with pytest.raises(PrecompileError, match="fits none of the artifact's 3 variants"):
        run(model, calls[0][0], 4.0, {})


def test_a_capture_whose_calls_take_other_arguments_is_refused(tmp_path: Path) -> None:
    def fn(a, b):
        return a(b) if isinstance(a, torch.nn.Module) else b(a)

    layer = torch.nn.Linear(4, 4)
    with (
        pytest.raises(
            PrecompileError,
            match="must take the same arguments.*a: model, b: input.*a: input, b: model",
        ),
        capture(fn, artifact_path=tmp_path / "a.py", backend="eager") as cap,
    ):
        cap(layer, torch.randn(2, 4))
        cap(torch.randn(2, 4), layer)
    assert not (tmp_path / "a.py").exists()


def test_the_spec_of_variants_round_trips_and_holds_shared_fields_once(variants_pair) -> None:
    code = variants_pair.read_text()
    spec = parse_spec(code)
    literal = to_literal(spec)
    assert all(not set(v) & {*ArtifactSpec.SHARED, "variants"} for v in literal["variants"])
    assert from_literal(literal) == spec
    bad = {**literal, "variants": ({**literal["variants"][0], "backend": "eager"},)}
    with pytest.raises(PrecompileError, match="malformed variant"):
        from_literal(bad)


def test_compile_on_one_rank_takes_one_kind_of_call(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch_precompile import PrecompileError, capture
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=__import__("datetime")
                              .timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        layer = torch.nn.Linear(4, 4)
        try:
            with capture(lambda m, x: m(x), artifact_path={str(tmp_path / "a.py")!r},
                         backend="eager", compile_on_one_rank=True) as cap:
                cap(layer, torch.randn(2, 4))
                cap(layer, torch.randn(2, 4))  # the same kind: runs
                cap(layer, torch.randn(3, 4))
        except PrecompileError as e:
            print("refused:", e)
        dist.destroy_process_group()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: with compile_on_one_rank=True a capture takes one kind of call" in proc.stdout


def test_a_graph_inside_a_function_gets_kernels_ready_not_pending() -> None:
    """A kernel Inductor builds in the background is handed out ready with resolve_now (a
    variant's names cannot be rebound by wait(globals())); without it, as Inductor gave it."""
    from torch_precompile.internals.vector_units import vector_bits
    from torch_precompile.shipped.kernel_loader import KernelLoader

    class Pending:
        def result(self) -> str:
            return "ready kernel"

    class Inductor:
        def cpp_pybinding(self, *args, **kwargs) -> Pending:
            return Pending()

    for resolve_now, expected in ((True, "ready kernel"), (False, Pending)):
        loader = KernelLoader({}, vector_bits=vector_bits(), resolve_now=resolve_now)
        loader._inductor = Inductor()
        kernel = loader.cpp_pybinding(["float*"], "source")
        assert kernel == expected if resolve_now else isinstance(kernel, expected)


def test_variants_of_one_shape_in_two_modes_each_run_their_own(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    eager = copy.deepcopy(model)
    xs = [torch.randn(6, 4) for _ in range(6)]
    with capture(lambda m, x: m(x), artifact_path=tmp_path / "a.py", backend="eager") as cap:
        cap(model.train(), xs[0])
        cap(model.eval(), xs[0])
    eager.load_state_dict(model.state_dict())
    run = precompile.load(tmp_path / "a.py")
    for step, x in enumerate(xs):  # train, eval, train, ...: BatchNorm's stats tell them apart
        training = step % 2 == 0
        assert_same(run(model.train(training), x), eager.train(training)(x))
        assert_same(model_state(model), model_state(eager))
