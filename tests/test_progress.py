"""Build progress: the steps of precompile() on stderr, through logging, and how to quiet it."""

from __future__ import annotations

import os
import re
import sys

from conftest import run_python, stderr_on_a_terminal

BUILD = """
import logging, torch
{setup}
from torch_precompile import precompile
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
precompile(lambda m, x: m(x), model, torch.randn(2, 4), backend="eager")
print("BUILT")
"""

STEPS = (
    "tracing fn (one traced run)",
    "lowering with the eager backend",
    "writing the artifact source",
)


def _stderr_of_build(setup: str = "") -> str:
    proc = run_python(BUILD.format(setup=setup))
    assert proc.returncode == 0 and "BUILT" in proc.stdout, proc.stderr[-3000:]
    return proc.stderr


def test_each_step_is_a_line_on_stderr_with_its_time() -> None:
    lines = _stderr_of_build().splitlines()
    for step in STEPS:
        assert f"torch-precompile: {step}..." in lines, lines
        assert any(line.startswith(f"torch-precompile: {step}: done in ") for line in lines)


def test_progress_is_quieted_by_a_logger_level() -> None:
    for logger in ("torch_precompile.progress", "torch_precompile"):
        stderr = _stderr_of_build(f"logging.getLogger({logger!r}).setLevel(logging.WARNING)")
        assert "torch-precompile:" not in stderr, (logger, stderr)


def test_a_process_that_configures_logging_gets_each_record_once() -> None:
    stderr = _stderr_of_build("logging.basicConfig(format='LOGGED %(name)s %(message)s')")
    assert "torch-precompile:" not in stderr  # the package's own handler stands aside
    assert stderr.count("LOGGED torch_precompile.progress tracing fn (one traced run): done") == 1


def test_on_a_terminal_a_step_is_redrawn_in_place() -> None:
    returncode, text = stderr_on_a_terminal(
        [sys.executable, "-c", BUILD.format(setup="")], timeout=300, env=dict(os.environ)
    )
    assert returncode == 0
    # The start has no line end of its own: a running clock, then its end, overwrite it.
    assert re.search(
        r"tracing fn \(one traced run\)\.\.\.[^\n]*\r\x1b\[Ktorch-precompile: "
        r"tracing fn \(one traced run\): done in \d+\.\d s\r?\n",
        text,
    ), text
