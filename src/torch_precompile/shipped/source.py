"""Modules that ship inside artifacts as source: the driver's parts and the kernel stand-ins.

Such a module is real, tested code in this package. In an artifact its docstring becomes a
comment (a loose string in mid-file reads as a mistake) and its imports are gathered with
those of the other shipped modules at the top of their section; imports of sibling driver
parts are dropped, since the artifact holds them all in one namespace. Everything else is
copied verbatim.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from torch_precompile.errors import PrecompileError

_SIBLINGS = "torch_precompile.shipped.driver."


@dataclass(frozen=True)
class ShippedSource:
    """A module's source as an artifact holds it: its imports apart, the rest as comment and
    code."""

    imports: tuple[ast.Import | ast.ImportFrom, ...]
    comment: str
    body: str


def shipped_source(module: ModuleType) -> ShippedSource:
    """Split ``module``'s source; its imports must all come before its first definition."""
    return shipped_text(inspect.getsource(module), module.__name__)


def shipped_text(source: str, name: str) -> ShippedSource:
    """Split the source of a module named ``name`` as ``shipped_source`` does."""
    tree = ast.parse(source)
    statements = list(tree.body)
    docstring = ast.get_docstring(tree, clean=True) or ""
    if docstring:
        statements = statements[1:]
    imports: list[ast.Import | ast.ImportFrom] = []
    while statements and isinstance(head := statements[0], ast.Import | ast.ImportFrom):
        imports.append(head)
        statements.pop(0)
    late = [s for s in statements if isinstance(s, ast.Import | ast.ImportFrom)]
    if late or any(isinstance(s, ast.ImportFrom) and s.module == "__future__" for s in imports):
        raise PrecompileError(f"internal: {name} has imports an artifact cannot hold")
    lines = source.splitlines()
    first = statements[0].lineno - 1 if statements else len(lines)
    while first > 0 and lines[first - 1].startswith("#"):  # comments above the first statement
        first -= 1
    kept = tuple(
        i
        for i in imports
        if not (isinstance(i, ast.ImportFrom) and (i.module or "").startswith(_SIBLINGS))
    )
    comment = "\n".join(f"# {line}".rstrip() for line in docstring.splitlines())
    return ShippedSource(kept, comment, "\n".join(lines[first:]).strip("\n") + "\n")


def import_block(imports: Sequence[ast.Import | ast.ImportFrom]) -> str:
    """The imports once each (names from one module merged), the standard library first."""
    plain: list[str] = []
    names: dict[str, list[str]] = {}
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                text = f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")
                if text not in plain:
                    plain.append(text)
        else:
            merged = names.setdefault(node.module or "", [])
            merged.extend(
                a.name + (f" as {a.asname}" if a.asname else "")
                for a in node.names
                if a.name not in merged
            )
    lines = plain + [
        f"from {module} import {', '.join(sorted(set(found)))}" for module, found in names.items()
    ]

    def order(line: str) -> tuple[bool, str]:
        module = line.split()[1]
        return module.split(".")[0] == "torch", module

    return "\n".join(sorted(lines, key=order)) + "\n"
