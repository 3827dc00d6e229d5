"""The command line as a user runs it: exit codes, output, and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import stderr_on_a_terminal

FACTORY = """
import torch
from torch import nn
from torch._dynamo.decorators import mark_unbacked


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    mark_unbacked(x, 0, min=1)
    return (lambda m, x: m(x).softmax(-1)), (model, x)


def make_static():
    torch.manual_seed(0)
    return (lambda m, x: m(x) * 2), (nn.Linear(4, 2), torch.randn(3, 4))


def not_a_pair():
    return 42
"""


def _cli(*args: str, cwd: Path, console_script: bool = False) -> subprocess.CompletedProcess[str]:
    if console_script:
        command = [str(Path(sys.executable).with_name("torch-precompile")), *args]
    else:
        command = [sys.executable, "-m", "torch_precompile", *args]
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    (folder / "factory.py").write_text(FACTORY)
    (folder / "key").write_bytes(b"sekrit")
    proc = _cli(
        "compile",
        "factory:make",
        "-o",
        "model.py",
        "--sign-key-file",
        "key",
        cwd=folder,
        console_script=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tracing fn" in proc.stderr and "kernels built and packed: " in proc.stderr
    assert "model.py (" in proc.stdout
    return folder


def test_inspect(compiled: Path) -> None:
    proc = _cli("inspect", "model.py", "--json", cwd=compiled)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["call"] == "forward(m, x)"
    assert report["inputs"][0]["shape"] == ["*", 4] and report["inputs"][0]["bounds"] == {
        "0": [1, None]
    }
    assert report["dynamic_dims"] == [{"shape_id": None, "dims": ["x[0]"]}]
    assert [p["name"] for p in report["parameters"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert report["cache"]["signed"] is True and report["cache"]["matches_source"] is True
    assert report["cache"]["runs_here"] == "yes" and len(report["cache"]["kernels"]) >= 1
    text = _cli("inspect", "model.py", cwd=compiled)
    assert text.returncode == 0 and "prebuilt  :" in text.stdout and "runs here: yes" in text.stdout
    assert "load      : runs from the cache" in text.stdout


def test_inspect_executes_nothing(compiled: Path, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    hostile = f"open({str(marker)!r}, 'w').close()\n" + (compiled / "model.py").read_text()
    (tmp_path / "model.py").write_text(hostile)
    proc = _cli("inspect", "model.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "cache     : missing" in proc.stdout
    assert not marker.exists()


def test_verify(compiled: Path) -> None:
    ok = _cli("verify", "model.py", "--key-file", "key", cwd=compiled)
    assert ok.returncode == 0 and "signature valid" in ok.stdout and "verified" in ok.stdout
    (compiled / "wrong").write_bytes(b"guess")
    bad = _cli("verify", "model.py", "--key-file", "wrong", cwd=compiled)
    assert bad.returncode == 1 and "FAILED: the artifact's signature does not match" in bad.stdout
    unkeyed = _cli("verify", "model.py", cwd=compiled)
    assert unkeyed.returncode == 3 and "signed, signature unchecked" in unkeyed.stdout


def test_verify_spots_a_corrupt_cache(compiled: Path, tmp_path: Path) -> None:
    for name in ("model.py", *(p.name for p in compiled.glob("model.*.cache"))):
        (tmp_path / name).write_bytes((compiled / name).read_bytes())
    cache = next(tmp_path.glob("model.*.cache"))
    data = bytearray(cache.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cache.write_bytes(bytes(data))
    proc = _cli("verify", "model.py", cwd=tmp_path)
    assert proc.returncode == 1 and "FAILED" in proc.stdout


def test_errors_of_the_work_are_one_line_and_exit_1(compiled: Path) -> None:
    (compiled / "not_an_artifact.py").write_text("x = 1\n")
    (compiled / "broken.py").write_text("raise RuntimeError('broken at import')\n")
    (compiled / "needs.py").write_text("import no_such_dependency\n\ndef make(): ...\n")
    for args, said in [
        (("inspect", "not_an_artifact.py"), "not_an_artifact.py"),
        (("verify", "not_an_artifact.py"), "not_an_artifact.py"),
        (("compile", "factory:not_a_pair", "-o", "x.py"), "must return (fn, example_inputs)"),
        (("compile", "broken:make", "-o", "x.py"), "broken at import"),
        (("compile", "needs:make", "-o", "x.py"), "no_such_dependency"),
    ]:
        proc = _cli(*args, cwd=compiled)
        assert proc.returncode == 1, (args, proc.stderr)
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("torch-precompile: error: ") and said in last, (args, last)
        assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("frobnicate",), "invalid choice: 'frobnicate'"),
        (("compile", "factory:make"), "the following arguments are required: -o/--output"),
        (("compile", "factory", "-o", "x.py"), "expected MODULE:FACTORY"),
        (("compile", "no_such_module:make", "-o", "x.py"), "no module named 'no_such_module'"),
        (("compile", "factory:no_such_factory", "-o", "x.py"), "has no 'no_such_factory'"),
        (("compile", "factory:make", "-o", "no_such_dir/x.py"), "no_such_dir is not a directory"),
        (
            ("compile", "factory:make", "-o", "x.py", "--sign-key-file", "absent.key"),
            "cannot read the key file absent.key",
        ),
        (
            ("compile", "factory:make", "-o", "x.py", "--sign-key-file", "empty.key"),
            "the key file empty.key is empty",
        ),
        (("compile", "factory:make", "-o", "x.py", "--backend", "tvm"), "invalid choice: 'tvm'"),
        (("inspect", "absent.py"), "absent.py does not exist"),
        (("inspect", "."), ". is a directory"),
        (("verify", "absent.py"), "absent.py does not exist"),
        (("verify", "model.py", "--key-file", "absent.key"), "cannot read the key file absent.key"),
        (("demo", "--out", "factory.py"), "factory.py exists and is not a folder"),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...], said: str, compiled: Path) -> None:
    (compiled / "empty.key").write_bytes(b"\n")
    proc = _cli(*args, cwd=compiled)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    # argparse's form: the command's usage, then one line naming the error.
    command = "" if args[0] == "frobnicate" else f" {args[0]}"
    error = proc.stderr.strip().splitlines()[-1]
    assert f"usage: torch-precompile{command} " in proc.stderr, proc.stderr
    assert error.startswith(f"torch-precompile{command}: error: ") and said in error, error
    assert "Traceback" not in proc.stderr and not (compiled / "x.py").exists()


def test_a_missing_factory_is_reported_as_missing_not_as_a_failed_import(
    tmp_path: Path,
) -> None:
    """The module imports: that step is done, and the error names what is missing from it and
    the functions the module defines."""
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\n\ndef make():\n    ...\n\n\ndef make_small():\n    ...\n\n\n"
        "def _private():\n    ...\n\n\nSIZE = 4\n"
    )
    proc = _cli("compile", "mymodels:make_big", "-o", "x.py", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "importing mymodels: done in" in proc.stderr, proc.stderr
    assert "importing mymodels: failed" not in proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error == (
        "torch-precompile compile: error: module 'mymodels' has no 'make_big'; it defines "
        "make, make_small. FACTORY names a function of MODULE that returns (fn, "
        "example_inputs)."
    ), error
    proc = _cli("compile", "mymodels:SIZE", "-o", "x.py", cwd=tmp_path)
    assert proc.returncode == 2 and "has a non-callable 'SIZE'; it defines make, " in proc.stderr


def test_help_exits_0(compiled: Path) -> None:
    help_text = _cli("--help", cwd=compiled)
    assert help_text.returncode == 0 and "compile" in help_text.stdout
    shown = " ".join(help_text.stdout.split())
    assert "2 usage error" in shown and "3 a signed pair verified without its key" in shown


def test_loaded_from_the_cli_output(compiled: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, factory\n"
            "from torch_precompile import precompile\n"
            "run = precompile.load_file('model.py', verify_key=b'sekrit')\n"
            "fn, (model, x) = factory.make()\n"
            "y = torch.randn(6, 4)\n"
            "assert torch.allclose(run(model, y), fn(model, y))\n"
            "print('OK')",
        ],
        cwd=compiled,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(compiled)},
    )
    assert proc.stdout.strip() == "OK", proc.stderr[-2000:]


def test_progress_is_live_on_a_terminal(compiled: Path) -> None:
    """On a terminal, stage lines are redrawn in place (carriage returns, a running clock)."""
    returncode, shown = stderr_on_a_terminal(
        [
            sys.executable,
            "-m",
            "torch_precompile",
            "compile",
            "factory:make_static",
            "-o",
            "tty.py",
            "--backend",
            "eager",
        ],
        cwd=compiled,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(compiled)},
    )
    assert returncode == 0
    assert "\r\x1b[K" in shown and "tracing fn (one traced run): done in" in shown
