"""Python values the traced code read: each becomes a check the artifact runs at every call.

A trace records tensor operations; a module attribute (``self.scaling``) or a module global
(``SCALE``) that the code multiplies by is baked into the graph as a number. So while ``fn``
is traced, every Python function entered is looked at once: the attribute paths it reads off
its first argument when that is one of the model's submodules (``self.p``,
``self.config.eps``) and the globals it names. Those holding plain values (numbers, strings,
bools, None, enum members, dtypes, functions, tuples of such) are recorded with the value they
had; the driver compares them at every call. Reads are found by reading each function's
bytecode, so a name used only in a branch the trace did not take is checked too (a stricter
check, never a missed one). Values held elsewhere (a closure cell, an object passed in) are
the caller's to keep; see docs/CONTRACT.md.
"""

from __future__ import annotations

import dis
import enum
import gc
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from torch_precompile.driver.core import qualified_name
from torch_precompile.errors import PrecompileError
from torch_precompile.spec import EncodedValue, ReadValue
from torch_precompile.trace.inputs import encode_value

_TORCH_ROOT = str(Path(torch.__file__).parent)
# The standard library's globals are its own (and some modules pose under another name). In a
# virtual environment "platstdlib" is the environment's lib/, which holds site-packages: take
# the base installation's, and never count installed packages as standard library.
_BASE_PATHS = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
_STDLIB_ROOTS = tuple({_BASE_PATHS["stdlib"], _BASE_PATHS["platstdlib"]})
_INSTALLED = ("site-packages", "dist-packages")
_PACKAGE_ROOT = str(Path(__file__).parents[1])
# torch's own module classes read their options (Dropout.p, LayerNorm.eps) in forward.
_TORCH_MODULES = str(Path(torch.__file__).parent / "nn" / "modules")
_SELF_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF"})
_PAIR_LOADS = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
# Attributes capture checks by other means (training flags) or that are no Python values.
_NOT_READS = frozenset({"training", "_parameters", "_buffers", "_modules"})


@dataclass(frozen=True)
class _CodeReads:
    """What one code object reads: attribute paths off its first argument, global names; each
    with the line of its first read."""

    self_name: str | None
    paths: tuple[tuple[tuple[str, ...], int], ...]
    globals: tuple[tuple[str, int], ...]


class ReadRecorder:
    """While active (``with``), records the plain values the Python code it sees reads.

    ``submodules`` are the model arguments' modules in walk order (their index is how a read
    names its module). Runs beside any tracer already installed (a debugger, coverage).
    """

    def __init__(self, submodules: Sequence[torch.nn.Module]) -> None:
        self.index = {id(m): i for i, m in enumerate(submodules)}
        self.submodules = submodules
        self.code_reads: dict[types.CodeType, _CodeReads | None] = {}
        self.reads: dict[tuple[Any, ...], ReadValue] = {}
        self.namespaces: dict[str, dict[str, Any]] = {}  # where each global was read
        self.previous: Any = None

    def __enter__(self) -> ReadRecorder:
        # Garbage-collection callbacks run inside any allocation; what they read is theirs.
        for callback in gc.callbacks:
            self.code_reads[getattr(callback, "__code__", None)] = None  # type: ignore[index]
        self.previous = sys.gettrace()
        sys.settrace(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)

    def _on_event(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            self._look(frame)
        previous = self.previous
        return previous(frame, event, arg) if previous is not None else None

    def _look(self, frame: types.FrameType) -> None:
        code = frame.f_code
        reads = self.code_reads.get(code, _UNSEEN)
        if reads is _UNSEEN:
            reads = self.code_reads[code] = _code_reads(code)
        if reads is None:
            return
        where = f"{Path(code.co_filename).name}:{{}} ({code.co_name})"
        if reads.paths:
            owner = frame.f_locals.get(reads.self_name) if reads.self_name else None
            index = self.index.get(id(owner))
            if index is not None:
                for path, line in reads.paths:
                    self._module_read(index, path, where.format(line))
        for name, line in reads.globals:
            self._global_read(frame.f_globals, name, where.format(line))

    def _module_read(self, index: int, path: tuple[str, ...], where: str) -> None:
        key = ("module", index, path)
        if key in self.reads:
            return
        namespace = vars(self.submodules[index])
        for depth, name in enumerate(path):
            if name not in namespace:
                return  # a parameter, buffer, submodule or class attribute: not a value
            value = namespace[name]
            encoded = encode_read(value)
            if encoded is not None:
                self.reads[key] = ReadValue(index, None, path[: depth + 1], encoded, where)
                return
            if not _is_plain_object(value):
                return
            namespace = vars(value)

    def _global_read(self, namespace: dict[str, Any], name: str, where: str) -> None:
        module = namespace.get("__name__")
        key = ("global", module, name)
        if key in self.reads or name not in namespace or not isinstance(module, str):
            return
        encoded = encode_read(namespace[name])
        if encoded is not None:
            self.namespaces[module] = namespace
            self.reads[key] = ReadValue(
                None, module, (name,), encoded, where, _script_name(module, namespace)
            )

    def records(self) -> tuple[ReadValue, ...]:
        """Every read, modules' attributes first (in walk order), then globals."""
        return tuple(
            sorted(
                self.reads.values(),
                key=lambda r: (r.submodule is None, r.submodule or 0, r.module or "", r.path),
            )
        )


_UNSEEN: Any = object()


def _script_name(module: str, namespace: dict[str, Any]) -> str | None:
    """For ``__main__``, the base name of its script: a later process whose ``__main__`` is
    another script has none of these globals to compare."""
    file = namespace.get("__file__")
    return os.path.basename(file) if module == "__main__" and isinstance(file, str) else None


def _code_reads(code: types.CodeType) -> _CodeReads | None:
    """The reads in ``code`` worth recording, or None (torch's internals, this package)."""
    filename = code.co_filename
    in_stdlib = filename.startswith(_STDLIB_ROOTS) and not any(p in filename for p in _INSTALLED)
    if (
        filename.startswith(_PACKAGE_ROOT)
        or in_stdlib
        or (filename.startswith("<") and not filename.startswith(("<ipython", "<stdin")))
    ):
        return None  # this package, the standard library, code made by exec (namedtuple)
    in_torch = filename.startswith(_TORCH_ROOT)
    if in_torch and not filename.startswith(_TORCH_MODULES):
        return None
    self_name = code.co_varnames[0] if code.co_argcount else None
    paths: dict[tuple[str, ...], int] = {}
    names: dict[str, int] = {}
    line = code.co_firstlineno
    instructions = list(dis.get_instructions(code))
    for i, instruction in enumerate(instructions):
        line = (instruction.positions and instruction.positions.lineno) or line
        if instruction.opname in _GLOBAL_LOADS and not in_torch:
            name = instruction.argval
            names.setdefault(name[1] if isinstance(name, tuple) else name, line)
        elif _loads_last(instruction) == self_name:
            path = tuple(_attribute_chain(instructions, i + 1))
            if path and path[0] not in _NOT_READS:
                paths.setdefault(path, line)
    if not paths and not names:
        return None
    return _CodeReads(self_name, tuple(paths.items()), tuple(names.items()))


def _loads_last(instruction: dis.Instruction) -> str | None:
    """The local an instruction leaves on top of the stack (Python 3.13 loads two at once)."""
    if instruction.opname in _SELF_LOADS:
        return cast(str, instruction.argval)
    if instruction.opname in _PAIR_LOADS:
        return cast(str, instruction.argval[1])
    return None


def _attribute_chain(instructions: Sequence[dis.Instruction], start: int) -> Iterator[str]:
    """The attribute names loaded one after another from ``start`` (``.config.eps``)."""
    for instruction in instructions[start : start + 2]:
        if instruction.opname not in _ATTR_LOADS:
            return
        name = instruction.argval
        yield name[1] if isinstance(name, tuple) else name


def _is_plain_object(value: Any) -> bool:
    """An object whose attributes a read may follow (a config), not a module or tensor."""
    return hasattr(value, "__dict__") and not isinstance(
        value,
        torch.nn.Module
        | torch.Tensor
        | type
        | types.ModuleType
        | types.FunctionType
        | types.MethodType
        | Callable,
    )


def encode_read(value: Any) -> EncodedValue | None:
    """A read value as the spec holds it; None for a value that is not a plain one."""
    if value is None:
        return ("none", None)
    if isinstance(value, tuple) and type(value) is tuple:
        items = [encode_read(v) for v in value]
        return None if any(i is None for i in items) else ("tuple", tuple(items))
    if isinstance(value, types.FunctionType) and "<" not in value.__qualname__:
        return ("callable", qualified_name(value))  # a lambda's name would say nothing
    if isinstance(value, enum.Enum | torch.dtype | torch.device) or type(value) in (
        bool,
        int,
        float,
        complex,
        str,
        bytes,
    ):
        try:
            return encode_value("a read value", value)
        except PrecompileError:
            return None
    return None


def drop_changed_reads(recorder: ReadRecorder) -> None:
    """Forget the values fn itself set while it was traced (a config field filled in on the
    first call, as transformers' classifiers set ``problem_type``): before the call they hold
    one value and after it another, so no single value is the one to insist on. Attributes of
    the model's modules that fn changes are refused by ``python_state``."""
    for key, read in list(recorder.reads.items()):
        if read.submodule is None:
            value = recorder.namespaces[read.module or ""].get(read.path[0])
        else:
            value = recorder.submodules[read.submodule]
            for name in read.path:
                value = getattr(value, name, None)
        if encode_read(value) != read.expected:
            del recorder.reads[key]
