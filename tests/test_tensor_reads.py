"""What fn's Python reads of an input tensor's layout and flags decides its branches once, in
the trace: each read is a fact every call is checked against, or a refusal at capture.

Before, each read below was baked into the artifact: a call with another layout, offset or
flag took the capture's branch and gave another result than eager with no error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from torch_precompile import PrecompileError, precompile

from conftest import run_python


def _scaled(flag: bool, out: torch.Tensor) -> torch.Tensor:
    return out * (2.0 if flag else 3.0)


def by_contiguous(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _scaled(x.is_contiguous(), m(x))


def by_stride(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * x.stride()[0]


def by_offset(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) * (1 + x.storage_offset())


def by_inference(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _scaled(x.is_inference(), m(x))


def by_negative(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _scaled(x.is_neg(), m(x))


def _inference(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return x.clone()


_BASE = torch.randn(20)
# Each read: fn, the example, another input with the same values where it matters, and what
# the refusal names.
READS: dict[str, tuple[Callable[..., Any], torch.Tensor, torch.Tensor, str]] = {
    "is_contiguous": (
        by_contiguous,
        torch.randn(4, 4),
        torch.randn(4, 4).t(),
        r"input x: fn read its strides at test_tensor_reads\.py:\d+ \(by_contiguous\), "
        r"\(4, 1\) at capture, and this call's is \(1, 4\)",
    ),
    "stride": (by_stride, torch.randn(4, 4), torch.randn(4, 4).t(), r"fn read its strides"),
    "storage_offset": (
        by_offset,
        _BASE[:16].view(4, 4),
        _BASE[4:].view(4, 4),
        r"fn read its storage offset at .*, 0 at capture, and this call's is 4",
    ),
    "is_inference": (
        by_inference,
        torch.randn(4, 4),
        _inference(torch.randn(4, 4)),
        r"fn read its is_inference\(\) at .*, False at capture, and this call's is True",
    ),
    "is_neg": (
        by_negative,
        torch.randn(4, 4),
        (-torch.randn(4, 4))._neg_view(),
        r"fn read its is_neg\(\) at .*, False at capture",
    ),
}


@pytest.mark.parametrize("read", list(READS))
def test_a_property_fn_reads_of_an_input_is_checked(backend: str, read: str) -> None:
    fn, example, other, refused = READS[read]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        code, cache = precompile(fn, model, example, backend=backend)
        run = precompile.load(code, cache)
        for _ in range(2):  # the second call takes the remembered path
            torch.testing.assert_close(run(model, example), fn(model, example))
        copy = other.clone() if read != "is_neg" else other
        if backend == "inductor" and read in ("is_contiguous", "stride", "is_neg"):
            refused = r"the compiled kernels"  # inductor's layout check comes first
        with pytest.raises(PrecompileError, match=refused):
            run(model, other)
        torch.testing.assert_close(other, copy, rtol=0, atol=0)  # nothing written
        torch.testing.assert_close(run(model, example.clone()), fn(model, example))
    expected = "stride" if read == "is_contiguous" else read
    assert [r[0] for r in precompile.inspect(code).inputs[0].read] == [expected]
    header = " ".join(line.removeprefix("# ") for line in code.splitlines()[:30])
    assert f"what fn's code read of one (x: {expected})" in header  # what a reader is told


def test_reads_torchs_own_code_makes_are_not_recorded() -> None:
    """Only fn's own code decides by what it reads; a module of torch's reading an input's
    layout to make it work (a convolution, a layer norm) adds no check, and the artifact stays
    plain."""
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3), torch.nn.LayerNorm(2))
    with torch.no_grad():
        code, _ = precompile(lambda m, x: m(x), model, torch.randn(1, 4, 4), backend="eager")
    assert precompile.inspect(code).inputs[0].read == ()
    assert "def check_call(" in code  # the generated checks of a plain artifact


def test_an_address_fn_reads_is_refused_at_capture() -> None:
    """An address differs at every call; no check can keep a branch on it."""
    model, x = torch.nn.Linear(4, 4), torch.randn(4, 4)
    before = [t.clone() for t in (model.weight, model.bias, x)]
    with pytest.raises(
        PrecompileError,
        match=r"fn reads the address of input x \(data_ptr\(\) at test_tensor_reads\.py:\d+",
    ):
        precompile(lambda m, x: m(x) * (2 if x.data_ptr() % 64 == 0 else 3), model, x)
    for t, saved in zip((model.weight, model.bias, x), before, strict=True):
        torch.testing.assert_close(t, saved, rtol=0, atol=0)


_FRESH = """
    import torch
    namespace = {{}}
    exec(open({code!r}).read(), namespace)
    forward = namespace["forward"]
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 4), torch.randn(4, 4)
    with torch.no_grad():
        expected = model(x) * 2.0
        torch.testing.assert_close(forward(model, x), expected)
        try:
            forward(model, x.t().contiguous().t())
        except Exception as error:
            print(type(error).__name__, error)
"""


def test_a_fresh_process_with_torch_alone_checks_the_read(tmp_path: Any) -> None:
    """The check is the artifact's own: a process with only torch, running the emitted
    source, refuses the transposed input as the package's load does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        code, _ = precompile(by_contiguous, model, torch.randn(4, 4), backend="eager")
    path = tmp_path / "artifact.py"
    path.write_text(code)
    done = run_python(_FRESH.format(code=str(path)), block_package=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("PrecompileError input x: fn read its strides at "), done.stdout


def test_a_flag_the_traced_copy_lacks_is_refused_at_capture() -> None:
    """fn is traced on a copy of each input, laid out as the example but without its
    inference bit: a branch on ``is_inference()`` would be decided for the copy, not for the
    example, so capture refuses it and says how to pass the example."""
    model = torch.nn.Linear(4, 4)
    example = _inference(torch.randn(4, 4))
    with (
        torch.no_grad(),
        pytest.raises(
            PrecompileError,
            match=r"fn reads is_inference\(\) of an input at test_tensor_reads\.py:\d+ "
            r"\(by_inference\), and the trace runs fn on a copy of the example, where it "
            r"gives False, not True",
        ),
    ):
        precompile(by_inference, model, example, backend="eager")
