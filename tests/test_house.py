"""The package's shape: no module imports another that imports it back, lazily or not (a
cycle ties two concerns into one, and makes import order matter); no module is longer than
a reader takes in; every folder says in its docstring what it holds."""

from __future__ import annotations

import ast
from pathlib import Path

import torch_precompile

PACKAGE = Path(torch_precompile.__file__).parent


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports, at any level."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                found = owner(target) if target.startswith(PACKAGE.name) else None
                # A module may import its own package (its __init__): that is not a cycle.
                if found is not None and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach each other through imports, one list per group."""
    reach = {name: _reachable(graph, name) for name in graph}
    groups = {
        frozenset(n for n in graph if n in reach[name] and name in reach[n]) for name in graph
    }
    return sorted(sorted(group) for group in groups if group)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(import_graph()) == []


def test_the_scan_sees_a_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE.name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(f"from {PACKAGE.name}.b import f\n")
    (package / "b.py").write_text(f"def f():\n    from {PACKAGE.name} import a\n")
    (package / "c.py").write_text(f"from {PACKAGE.name} import a\n")
    graph = import_graph(package)
    assert graph[f"{PACKAGE.name}.c"] == {f"{PACKAGE.name}.a"}
    assert cycles(graph) == [[f"{PACKAGE.name}.a", f"{PACKAGE.name}.b"]]


def test_no_module_is_longer_than_six_hundred_lines() -> None:
    lengths = {
        str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
    }
    assert len(lengths) > 100  # the scan sees the whole package
    assert {name: n for name, n in lengths.items() if n > 600} == {}


def test_every_folder_of_the_package_says_what_it_holds() -> None:
    folders = [p.parent for p in PACKAGE.rglob("__init__.py")]
    assert len(folders) >= 10
    for folder in folders:
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert docstring and len(docstring.split()) >= 8, folder
