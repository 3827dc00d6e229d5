"""Runs of alike spec records, as ``ARTIFACT_SPEC`` writes them once each.

A deep model's spec holds a record per tensor and submodule of every block, alike but for
numbers that step from block to block (``'3.ln1.weight'``, then ``'4.ln1.weight'``). Such a
run is written as one dict: ``{'repeat': n, 'records': (...), 'steps': ((j, field, steps),
...)}``, the records those of the first block; in repeat ``r`` a field that steps is record
``j``'s value with each of its numbers (an int, or each run of digits of a str that may step)
raised by ``r`` times its step. ``unfolded_spec`` lists every record again.
"""

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch_precompile.shipped.driver.tensor_rules import PrecompileError

_DIGITS = re.compile(r"\d+")
_FOLD_KEYS = {"repeat", "records", "steps"}


def stepping_digits(text: str) -> list[Any]:
    """The runs of digits in ``text`` that step in a fold: those ``str(int)`` writes."""
    return [m for m in _DIGITS.finditer(text) if str(int(m[0])) == m[0] and len(m[0]) <= 18]


def stepped(value: Any, steps: Sequence[int], repeat: int) -> Any:
    """``value`` (an int, or a str) with each of its numbers raised by ``repeat`` steps."""
    if isinstance(value, int) and not isinstance(value, bool) and len(steps) == 1:
        return value + repeat * steps[0]
    if not isinstance(value, str):
        raise PrecompileError(f"ARTIFACT_SPEC holds a malformed run of records (steps {value!r})")
    runs = stepping_digits(value)
    if len(runs) != len(steps):
        raise PrecompileError(f"ARTIFACT_SPEC holds a malformed run of records (at {value!r})")
    parts, at = [], 0
    for run, step in zip(runs, steps, strict=True):
        parts += [value[at : run.start()], str(int(run[0]) + repeat * step)]
        at = run.end()
    return "".join([*parts, value[at:]])


def is_fold(item: Any) -> bool:
    """Whether a spec list item is a run of records written once."""
    return isinstance(item, Mapping) and item.keys() == _FOLD_KEYS


def unfolded(items: Sequence[Any]) -> tuple[Any, ...]:
    """A spec list with each run of records written out again."""
    out: list[Any] = []
    for item in items:
        if not is_fold(item):
            out.append(item)
            continue
        records, repeat = item["records"], item["repeat"]
        changes: dict[int, list[tuple[str, Sequence[int]]]] = {}
        for index, field, steps in item["steps"]:
            changes.setdefault(index, []).append((field, steps))
        for r in range(repeat):
            for index, record in enumerate(records):
                moved = {f: stepped(record[f], s, r) for f, s in changes.get(index, ())}
                out.append({**record, **moved})
    return tuple(out)


def unfolded_spec(literal: Mapping[str, Any]) -> dict[str, Any]:
    """``ARTIFACT_SPEC`` (and each variant in it) with every run of records written out."""
    spec = {
        name: unfolded(value)
        if isinstance(value, tuple) and any(is_fold(v) for v in value)
        else value
        for name, value in literal.items()
    }
    if spec.get("variants"):
        spec["variants"] = tuple(unfolded_spec(v) for v in spec["variants"])
    return spec
