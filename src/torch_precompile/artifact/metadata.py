"""Calling-convention metadata: written as top-level literals, read back without executing."""

from __future__ import annotations

import ast
import pprint
from typing import Any

from torch_precompile.convention import METADATA_NAMES, CallingConvention
from torch_precompile.errors import PrecompileError

_NOT_AN_ARTIFACT = "it is not a precompile artifact (python_code from precompile())"
# The layout of python_code; an artifact of another format is refused, not half-understood.
ARTIFACT_FORMAT = "torch-precompile artifact 1"
METADATA_TITLE = "The calling convention (read by load() without executing this file)"
DRIVER_TITLE = "The driver: forward(*args) checks a call and runs call()"


def metadata_source(convention: CallingConvention) -> str:
    """One ``NAME = literal`` assignment per field; ``parse_metadata`` is its inverse."""
    lines = [f"ARTIFACT_FORMAT = {ARTIFACT_FORMAT!r}"]
    for name, value in convention.literals().items():
        text = pprint.pformat(value, width=96, compact=True, sort_dicts=False)
        lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"


def parse_metadata(python_code: str) -> dict[str, Any]:
    """Read the metadata literals of ``python_code`` by parsing only; nothing is executed."""
    if not isinstance(python_code, str):
        raise PrecompileError(
            f"python_code must be a str, got {type(python_code).__name__}; {_NOT_AN_ARTIFACT}."
        )
    found = _literals(_metadata_section(python_code))
    if not found:  # not laid out as rendered: read the whole module
        found = _literals(python_code)
    artifact_format = found.pop("ARTIFACT_FORMAT", None)
    return _checked(found, artifact_format)


def _metadata_section(python_code: str) -> str:
    """Section 3 alone: parsing it is fast, where the kernels' source makes the whole slow."""
    start = python_code.find(f"# 3. {METADATA_TITLE}\n")
    end = python_code.find(f"# 4. {DRIVER_TITLE}\n", start)
    if start < 0 or end < 0:
        return ""
    return python_code[start:end]


def _literals(source: str) -> dict[str, Any]:
    """The metadata assignments at the top level of ``source``, evaluated as literals."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise PrecompileError(
            f"python_code does not parse (line {e.lineno}: {e.msg}); {_NOT_AN_ARTIFACT}."
        ) from e
    found: dict[str, Any] = {}
    wanted = {"ARTIFACT_FORMAT", *METADATA_NAMES}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in wanted
        ):
            name = node.targets[0].id
            try:
                found[name] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError) as e:
                raise PrecompileError(
                    f"python_code's {name} is not a literal; {_NOT_AN_ARTIFACT}."
                ) from e
    return found


def _checked(found: dict[str, Any], artifact_format: Any) -> dict[str, Any]:
    if artifact_format is not None and artifact_format != ARTIFACT_FORMAT:
        raise PrecompileError(
            f"python_code is a {artifact_format!r}, made by another version of torch-precompile; "
            f"this version reads {ARTIFACT_FORMAT!r}. Precompile it again with this version."
        )
    missing = [name for name in METADATA_NAMES if name not in found]
    if artifact_format is None:
        missing.insert(0, "ARTIFACT_FORMAT")
    if missing:
        raise PrecompileError(
            f"python_code lacks the metadata {', '.join(missing)}; {_NOT_AN_ARTIFACT}."
        )
    return found
