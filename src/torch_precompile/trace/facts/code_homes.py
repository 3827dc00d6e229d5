"""Whose code a file or function is (torch's, this package's, the standard library's, an
installed package's, or the user's), and where a function ``fn`` runs from: the global of its
module that holds it, through which a call can reach what it closes over."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

import torch

TORCH_ROOT = str(Path(torch.__file__).parent)  # torch's own code
# The standard library's globals are its own (and some modules pose under another name). In a
# virtual environment "platstdlib" is the environment's lib/, which holds site-packages: take
# the base installation's, and never count installed packages as standard library.
_BASE_PATHS = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
STDLIB_ROOTS = tuple({_BASE_PATHS["stdlib"], _BASE_PATHS["platstdlib"]})
INSTALLED = ("site-packages", "dist-packages")
PACKAGE_ROOT = str(Path(__file__).parents[2])  # this package's code


def torch_own(kind: type) -> bool:
    """Whether a class (a tensor subclass, a mode) is torch's or this package's."""
    module = getattr(kind, "__module__", None)  # not always a string on made-up classes
    return isinstance(module, str) and module.partition(".")[0] in ("torch", "torch_precompile")


def users_file(filename: str) -> bool:
    """Whether ``filename`` is the user's own code: not torch, this package, the standard
    library or an installed package."""
    return not (
        filename.startswith((TORCH_ROOT, PACKAGE_ROOT))
        or in_standard_library(filename)
        or any(p in filename for p in INSTALLED)
    )


def script_name(module: str, namespace: dict[str, Any]) -> str | None:
    """For ``__main__``, the base name of its script: a later process whose ``__main__`` is
    another script has none of these globals to compare."""
    file = namespace.get("__file__")
    return os.path.basename(file) if module == "__main__" and isinstance(file, str) else None


def runs_as_function(fn: Any) -> Any:
    """The function whose code runs first when ``fn`` is called: a partial's, a bound
    method's, a callable object's ``__call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, types.MethodType):
        return fn.__func__
    if isinstance(fn, types.FunctionType):
        return fn
    method = getattr(type(fn), "forward" if isinstance(fn, torch.nn.Module) else "__call__", None)
    return getattr(method, "__func__", method)


def function_home(fn: Any) -> tuple[types.CodeType, dict[str, Any], str] | None:
    """fn's code, its module's globals and the global there that holds fn (the first, by
    identity), where fn is a function of the user's that closes over values; None otherwise."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return None
    module = sys.modules.get(fn.__module__)
    if module is None or not users_file(fn.__code__.co_filename):
        return None
    namespace = vars(module)
    held = global_holding(namespace, fn)
    return None if held is None else (fn.__code__, namespace, held)


def global_holding(namespace: dict[str, Any], value: Any) -> str | None:
    """The first global of ``namespace`` that holds ``value`` itself, if any."""
    return next((k for k, v in namespace.items() if v is value and not k.startswith("__")), None)


def runs_as(function: Any) -> Any:
    """The object of the user's that ``function`` belongs to (a trainer whose bound ``step`` it
    is, an object with ``__call__``), or None."""
    while isinstance(function, functools.partial):
        function = function.func
    owner = function.__self__ if isinstance(function, types.MethodType) else function
    plain = not isinstance(
        owner, types.FunctionType | types.BuiltinFunctionType | type | torch.nn.Module
    )
    file = getattr(sys.modules.get(type(owner).__module__), "__file__", None)
    users = isinstance(file, str) and users_file(file)
    return owner if plain and users and hasattr(owner, "__dict__") else None


def in_standard_library(filename: str) -> bool:
    """Whether ``filename`` is a module of Python's standard library (not an installed
    package, though a virtual environment keeps those under its own lib/)."""
    return filename.startswith(STDLIB_ROOTS) and not any(p in filename for p in INSTALLED)
