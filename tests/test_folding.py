"""Runs of alike lines and spec records written once: the loop does what the lines did, the
spec reads back record for record, and what cannot fold stays as it was."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

from test_blocks import Net, infer
from torch_precompile import PrecompileError, precompile
from torch_precompile.folding import Pattern, find_runs, fold_lines
from torch_precompile.spec import parse_spec


def _unrolled(blocks: int) -> list[str]:
    lines = ["def check(log, tensors):", "    log.append(('head', tensors[0]))"]
    for b in range(blocks):
        lines += [
            f"    log.append(('{b}.norm.weight', tensors[{3 * b + 1}], (16,)))",
            f"    log.append((\"block {b}: {{'{b + 1}'}}\", tensors[{3 * b + 2}] - {b}))",
            f"    log.append(('{b}.up.bias', tensors[{3 * b + 3}] * 2))",
        ]
    lines += ["    log.append(sorted([", *(f"        '{b}.x'," for b in range(blocks)), "    ]))"]
    return lines


def _run(lines: list[str]) -> list[Any]:
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)
    log: list[Any] = []
    namespace["check"](log, list(range(100)))
    return log


@pytest.mark.parametrize("blocks", [2, 3, 12])
def test_a_folded_function_does_what_its_lines_did(blocks: int) -> None:
    lines = _unrolled(blocks)
    folded = fold_lines(lines)
    assert _run(folded) == _run(lines)
    if blocks < 3:  # two alike blocks stay written out
        assert folded == lines
    else:
        assert any(line.startswith("    for k in range(") for line in folded)
        assert len(folded) < len(lines) - blocks


def test_lines_that_cannot_stand_in_a_loop_stay_as_they_were() -> None:
    late = [f"    hooks.append(lambda: tensors[{i}])" for i in range(6)]
    lazy = [f"    gens.append(t for t in tensors[{i}:])" for i in range(6)]
    block = [f"    if tensors[{i}]:" for i in range(6)]
    for body in (late, lazy, block):
        lines = ["def f(hooks, gens, tensors):", *body, "    pass"]
        assert fold_lines(lines) == lines


def test_the_counter_takes_a_name_the_lines_do_not_use() -> None:
    lines = textwrap.dedent(
        """\
        def f(out, k):
            out.append(k + 0)
            out.append(k + 1)
            out.append(k + 2)
            out.append(k + 3)
            out.append(k + 4)
            out.append(k + 5)
        """
    ).splitlines()
    folded = fold_lines(lines)
    assert "for k_ in range(6):" in "\n".join(folded)
    assert _call(folded, 10) == _call(lines, 10) == [10, 11, 12, 13, 14, 15]


def _call(lines: list[str], k: int) -> list[int]:
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)
    out: list[int] = []
    namespace["f"](out, k)
    return out


def test_runs_are_the_longest_with_the_shortest_period() -> None:
    shapes = ["a", "b", "a", "b", "a", "b", "c"]
    patterns = [Pattern(s, (i,)) for i, s in enumerate(shapes)]
    (run,) = find_runs(patterns)
    assert (run.start, run.period, run.repeats, run.steps) == (0, 2, 3, ((2,), (2,)))
    assert find_runs([Pattern("a", (0,)), Pattern("a", (1,)), Pattern("a", (5,))]) == []


@pytest.fixture(scope="module")
def deep_artifact() -> tuple[str, Net]:
    torch.manual_seed(0)
    model, x = Net(depth=5), torch.randn(4, 8)
    with torch.no_grad():
        code, _ = precompile(infer, model, x, backend="eager", blocks=False)
    return code, model


def test_the_spec_writes_each_run_of_blocks_once_and_reads_back_every_record(
    deep_artifact: tuple[str, Net],
) -> None:
    code, model = deep_artifact
    assert "{'repeat': 5," in code
    spec = parse_spec(code)
    assert [t.name for t in spec.model] == [name for name, _ in model.named_parameters()]
    assert [m.name for m in spec.submodules] == [name for name, _ in model.named_modules()]


def test_a_malformed_run_of_records_is_refused_by_name(deep_artifact: tuple[str, Net]) -> None:
    code, _ = deep_artifact
    broken = code.replace("{'repeat': 5,", "{'repeat': 'five',", 1)
    with pytest.raises(PrecompileError, match="malformed run of records"):
        parse_spec(broken)
