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
_FORMATTER_DIRECTIVES = ("# fmt: off", "# fmt: on")


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
    # The formatter's directives are for this package's sources, not for an artifact's reader.
    body = [line for line in lines[first:] if line.strip() not in _FORMATTER_DIRECTIVES]
    return ShippedSource(kept, comment, "\n".join(body).strip("\n") + "\n")


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


def defined_names(statement: ast.stmt) -> set[str]:
    """The module-level names a top-level statement binds."""
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {statement.name}
    targets: list[ast.expr] = []
    if isinstance(statement, ast.Assign):
        targets = list(statement.targets)
    elif isinstance(statement, ast.AnnAssign | ast.AugAssign):
        targets = [statement.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def used_names(tree: ast.AST) -> set[str]:
    """Every bare name ``tree`` mentions (quoted annotations are never evaluated)."""
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


@dataclass(frozen=True)
class _Block:
    """A top-level statement of a shipped body with the comments and blank lines above it."""

    text: str
    defines: frozenset[str]
    uses: frozenset[str]


def _blocks(body: str) -> list[_Block]:
    lines = body.splitlines()
    blocks: list[_Block] = []
    start = 0
    for statement in ast.parse(body).body:
        end = statement.end_lineno or statement.lineno
        text = "\n".join(lines[start:end])
        defines = frozenset(defined_names(statement))
        blocks.append(_Block(text, defines, frozenset(used_names(statement))))
        start = end
    return blocks


def used_only(sources: Sequence[ShippedSource], roots: str) -> list[ShippedSource]:
    """``sources`` cut to the definitions the code in ``roots`` reaches, directly or through
    one another, and to the imports those use. A source none of whose definitions is reached
    goes whole (its comment too); a statement that binds no name is always kept. An artifact
    so carries nothing for features it does not use."""
    per_source = [_blocks(source.body) for source in sources]
    owners = {name: block for blocks in per_source for block in blocks for name in block.defines}
    reached: set[int] = set()
    from_roots = used_names(ast.parse(roots))
    pending = list(from_roots)
    pending += [n for blocks in per_source for b in blocks if not b.defines for n in b.uses]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in owners:
            continue
        seen.add(name)
        block = owners[name]
        if id(block) not in reached:
            reached.add(id(block))
            pending.extend(block.uses)
    kept: list[ShippedSource] = []
    for source, blocks in zip(sources, per_source, strict=True):
        chosen = [b for b in blocks if id(b) in reached or not b.defines]
        if not chosen:
            continue
        body = "\n".join(b.text for b in chosen).strip("\n") + "\n"
        used = used_names(ast.parse(body)) | from_roots
        kept.append(ShippedSource(_used_imports(source.imports, used), source.comment, body))
    return kept


def _used_imports(
    imports: Sequence[ast.Import | ast.ImportFrom], used: set[str]
) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """``imports`` with only the names in ``used`` (``import a.b`` binds ``a``)."""
    kept: list[ast.Import | ast.ImportFrom] = []
    for node in imports:
        names = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
        if names and isinstance(node, ast.Import):
            kept.append(ast.Import(names=names))
        elif names and isinstance(node, ast.ImportFrom):
            kept.append(ast.ImportFrom(module=node.module, names=names, level=node.level))
    return tuple(kept)
