"""Only the torch layer (``internals/``) may name torch's private modules and attributes.

The driver and the kernel stand-ins ship inside artifacts and cannot import the package; they
keep their own few touches, pinned here so that a new one is a conscious change.

A touch is an import or ``torch.`` attribute chain with a private part, a string naming a
private torch module passed to a call (``importlib.import_module("torch._inductor.x")``), or
a private attribute read on any object (``node.target._schema``, ``getattr(t, "_base")``)
or a private keyword argument (``_error_on_data_dependent_ops=False``) whose name the package
does not define itself. These last kinds are written ``._name`` and ``_name=``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import torch_precompile

PACKAGE = Path(torch_precompile.__file__).parent
# Keyed by shipped part: "driver" is driver.py or every module of a driver/ package.
SHIPPED = {
    "driver": {
        "torch._C._set_grad_enabled",
        "torch.utils._pytree",
        "torch._C._dynamo.guards.TensorGuards",
        "torch._C._distributed_c10d",
        "._parameters",
        "._buffers",
        "._modules",
        "._base",
        "._register_process_group",
        "._unregister_process_group",
        "torch.optim.optimizer._global_optimizer_pre_hooks",
        "torch.optim.optimizer._global_optimizer_post_hooks",
        "._optimizer_step_pre_hooks",
        "._optimizer_step_post_hooks",
        "._opt_called",
        "._wrapped_by_lr_sched",
        "._get_fsdp_state",
        "._fsdp_param_groups",
        "torch.distributed.tensor.placement_types._StridedShard",
        # Not torch: the no-history warning finds the caller's frame (sys._getframe).
        "._getframe",
        # The state a call must share with the capture (AmbientPlan).
        "torch._C._is_any_autocast_enabled",
        "torch._C._get_deterministic_algorithms",
        "torch._C._len_torch_function_stack",
        "torch._C._len_torch_dispatch_stack",
        "torch.overrides._get_current_function_mode_stack",
        "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
        # Whether another tensor holds a written input's storage (check_written_apart).
        "torch._C._storage_Use_Count",
        "._cdata",
    },
    "kernel_loader": {
        "torch._inductor.async_compile.AsyncCompile",
        "torch._inductor.config",
        "torch._inductor.cpu_vec_isa.pick_vec_isa",
        "torch._inductor.codecache.CppWrapperCodeCache",
    },
    "wrapper_imports": {"torch._inductor.kernel", "torch._inductor.select_algorithm"},
}
_TORCH_NAME = re.compile(r"torch(\.\w+)+")
_ATTRIBUTE_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}
# Public despite the underscore: namedtuple's API.
_PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _is_private_torch(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "torch" and (
        any(_is_private(p) for p in parts[1:]) or name.startswith("torch.fx.experimental")
    )


def _chain(node: ast.Attribute) -> tuple[ast.expr, list[str]]:
    """The chain's root expression and its attribute names, outermost last."""
    parts: list[str] = []
    value: ast.expr = node
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    return value, list(reversed(parts))


def _is_operator_name(root: ast.expr, parts: list[str]) -> bool:
    """ATen operators with a leading underscore (``aten._to_copy``) are public operators."""
    path = [root.id, *parts] if isinstance(root, ast.Name) else []
    return path[:1] == ["aten"] or path[:3] == ["torch", "ops", "aten"]


def _attribute_touches(node: ast.AST, own: frozenset[str]) -> list[str]:
    """Private attributes read on objects other than ``self``/``cls`` and torch chains, and
    private keywords (``make_fx(f, _error_on_data_dependent_ops=False)``)."""
    if isinstance(node, ast.Attribute):
        root, parts = _chain(node)
        if (
            not _is_private(node.attr)
            or node.attr in own
            or node.attr in _PUBLIC_UNDERSCORED
            or _is_operator_name(root, parts)
        ):
            return []
        receiver = node.value
        if isinstance(receiver, ast.Name) and receiver.id in {"self", "cls", "torch"}:
            return []
        if isinstance(root, ast.Name) and root.id == "torch":
            return []  # a torch chain: reported whole by _import_and_chain_names
        return ["." + node.attr]
    if isinstance(node, ast.keyword) and node.arg and _is_private(node.arg):
        return [] if node.arg in own else [node.arg + "="]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _ATTRIBUTE_BUILTINS
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        name = node.args[1].value
        if _is_private(name) and name not in own and name not in _PUBLIC_UNDERSCORED:
            return ["." + name]
    return []


def _import_and_chain_names(node: ast.AST) -> list[str]:
    """Dotted torch names: imports, ``torch.`` attribute chains, strings passed to calls."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [f"{node.module}.{alias.name}" for alias in node.names]
    if isinstance(node, ast.Attribute):
        root, parts = _chain(node)
        if isinstance(root, ast.Name) and root.id == "torch" and not _is_operator_name(root, parts):
            return [".".join(["torch", *parts])]
    if isinstance(node, ast.Call):
        arguments = [*node.args, *(k.value for k in node.keywords)]
        return [
            a.value
            for a in arguments
            if isinstance(a, ast.Constant)
            and isinstance(a.value, str)
            and _TORCH_NAME.fullmatch(a.value)
        ]
    return []


def _touches(source: str, own: frozenset[str] = frozenset()) -> dict[str, int]:
    """Each private torch touch in ``source``, with the first line it appears on."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        names = [n for n in _import_and_chain_names(node) if _is_private_torch(n)]
        names += _attribute_touches(node, own)
        for name in names:
            found.setdefault(name, getattr(node, "lineno", 0))
    return found


def _private_torch_names(source: str, own: frozenset[str] = frozenset()) -> set[str]:
    return set(_touches(source, own))


def _defined_names(source: str) -> set[str]:
    """Names a module defines: functions, classes, assignments (module, class and ``self.``
    level, dataclass fields included), parameters, imports' local names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in {"self", "cls"}
        ):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return names


@functools.cache
def _package_names() -> frozenset[str]:
    names = {path.stem for path in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        names |= _defined_names(path.read_text())
    return frozenset(names)


def _shipped_part(relative: Path) -> str | None:
    """Which shipped part a module of ``shipped/`` is (its copier, ``source``, is none)."""
    if relative.parts[0] != "shipped" or len(relative.parts) < 2:
        return None
    if relative.parts[1] == "driver":
        return "driver"
    return {"kernel_loader.py": "kernel_loader", "wrapper_imports.py": "wrapper_imports"}.get(
        relative.parts[1]
    )


def _longest(names: set[str]) -> set[str]:
    """Whole chains only: ``torch._C._f`` also yields ``torch._C``, which is dropped."""
    return {n for n in names if not any(m.startswith(n + ".") for m in names)}


def test_only_the_torch_layer_names_torch_internals() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "internals" or _shipped_part(relative) is not None:
            continue
        touches = _touches(path.read_text(), _package_names())
        if touches:
            offenders[str(relative)] = sorted(f"{n} (line {line})" for n, line in touches.items())
    assert offenders == {}, f"private torch names outside internals/: {offenders}"


def test_shipped_modules_keep_their_few_torch_touches() -> None:
    touches: dict[str, set[str]] = {part: set() for part in SHIPPED}
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _shipped_part(path.relative_to(PACKAGE))
        if part is not None:
            touches[part] |= _private_torch_names(path.read_text(), _package_names())
    for part, allowed in SHIPPED.items():
        assert _longest(touches[part]) == allowed, (part, _longest(touches[part]))


def test_the_scan_sees_imports_and_attribute_chains() -> None:
    source = (
        "import torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
        "from torch.fx.experimental.proxy_tensor import make_fx\nx = torch._C._foo\n"
        "y = torch.nn.Linear\n"
    )
    assert _private_torch_names(source) >= {
        "torch._dynamo",
        "torch.utils._pytree.tree_map",
        "torch.fx.experimental.proxy_tensor.make_fx",
        "torch._C._foo",
    }
    assert not any("Linear" in n for n in _private_torch_names(source))


def test_the_scan_sees_private_attributes_and_module_strings() -> None:
    source = (
        "schema = node.target._schema\nparams = module._parameters\n"
        "base = getattr(grad, '_base', None)\n"
        "gm = make_fx(f, _error_on_data_dependent_ops=False)\n"
        "m = importlib.import_module('torch._inductor.x')\n"
        "f = LazyImport(module='torch._inductor.select_algorithm', name='extern_kernels')\n"
    )
    assert _private_torch_names(source) == {
        "._schema",
        "._parameters",
        "._base",
        "_error_on_data_dependent_ops=",
        "torch._inductor.x",
        "torch._inductor.select_algorithm",
    }


def test_the_scan_spares_own_names_self_and_operators() -> None:
    source = (
        "class A:\n    def f(self):\n        return self._memo, cls._table\n"
        "t = point._replace(x=1)\nop = aten._to_copy.default\n"
        "op2 = torch.ops.aten._softmax.default\nhelper = other._known\n"
        "ok = importlib.import_module('torch.nn')\n"
        "own(_known=1)\n"
        "said = 'mentions torch._inductor.x in a sentence'\n"
    )
    assert _private_torch_names(source, frozenset({"_known"})) == set()
