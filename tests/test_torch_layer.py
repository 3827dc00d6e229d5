"""Only the torch layer (``internals/``) may name torch's private modules and attributes.

The driver and the kernel stand-ins ship inside artifacts and cannot import the package; they
keep their own few touches, pinned here so that a new one is a conscious change.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch_precompile

PACKAGE = Path(torch_precompile.__file__).parent
SHIPPED = {"driver.py": {"torch._C._set_grad_enabled", "torch.utils._pytree",
                         "torch._C._dynamo.guards.TensorGuards", "torch._C._distributed_c10d"},
           "kernel_loader.py": {"torch._inductor.async_compile.AsyncCompile"}}


def _private_torch_names(source: str) -> set[str]:
    """Dotted torch names in ``source`` (imports and attribute chains) with a private part."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            parts = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch":
                names = [".".join(["torch", *reversed(parts)])]
        for name in names:
            parts = name.split(".")
            if parts[0] == "torch" and (any(p.startswith("_") and not p.startswith("__")
                                            for p in parts[1:])
                                        or name.startswith("torch.fx.experimental")):
                found.add(name)
    return found


def _longest(names: set[str]) -> set[str]:
    """Whole chains only: ``torch._C._f`` also yields ``torch._C``, which is dropped."""
    return {n for n in names if not any(m.startswith(n + ".") for m in names)}


def test_only_the_torch_layer_names_torch_internals() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "internals" or str(relative) in SHIPPED:
            continue
        names = _private_torch_names(path.read_text())
        if names:
            offenders[str(relative)] = sorted(names)
    assert offenders == {}, f"private torch names outside internals/: {offenders}"


def test_shipped_modules_keep_their_few_torch_touches() -> None:
    for name, allowed in SHIPPED.items():
        touches = _longest(_private_torch_names((PACKAGE / name).read_text()))
        assert touches == allowed, (name, touches)


def test_the_scan_sees_imports_and_attribute_chains() -> None:
    source = ("import torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
              "from torch.fx.experimental.proxy_tensor import make_fx\nx = torch._C._foo\n"
              "y = torch.nn.Linear\n")
    assert _private_torch_names(source) >= {"torch._dynamo", "torch.utils._pytree.tree_map",
                                            "torch.fx.experimental.proxy_tensor.make_fx",
                                            "torch._C._foo"}
    assert not any("Linear" in n for n in _private_torch_names(source))
