"""What a function's bytecode reads, found once per code object: the attribute paths off its
first argument, the globals it names, and the types whose values it calls."""

from __future__ import annotations

import dis
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from torch_precompile.trace.facts.code_homes import (
    INSTALLED,
    PACKAGE_ROOT,
    TORCH_ROOT,
    in_standard_library,
)

# torch's own module classes read their options (Dropout.p, LayerNorm.eps) in forward.
_TORCH_MODULES = str(Path(torch.__file__).parent / "nn" / "modules")
_SELF_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF"})


_PAIR_LOADS = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
# Attributes capture checks by other means (training flags) or that are no Python values.
NOT_READS = frozenset({"training", "_parameters", "_buffers", "_modules"})


@dataclass(frozen=True)
class CodeReads:
    """What one code object reads: attribute paths off its first argument, and global names
    with the attributes read off them (``("config", "SCALE")``); each with the line of its
    first read."""

    self_name: str | None
    paths: tuple[tuple[tuple[str, ...], int], ...]
    globals: tuple[tuple[tuple[str, ...], int], ...]
    closed_over: tuple[tuple[str, int], ...] = ()  # free variables it loads
    # Attribute names the code reads off anything (``layer.scale`` in a loop,
    # ``self.layers[0].scale``, ``self.block.scale``, ``getattr(layer, "on", True)``): whether
    # by getattr or hasattr with a constant name, and the line.
    off_others: tuple[tuple[str, bool, int], ...] = ()


def code_reads(code: types.CodeType) -> CodeReads | None:
    """The reads in ``code`` worth recording, or None (torch's internals, this package)."""
    filename = code.co_filename
    if (
        filename.startswith(PACKAGE_ROOT)
        or in_standard_library(filename)
        or (filename.startswith("<") and not filename.startswith(("<ipython", "<stdin")))
    ):
        return None  # this package, the standard library, code made by exec (namedtuple)
    in_torch = filename.startswith(TORCH_ROOT)
    if in_torch and not filename.startswith(_TORCH_MODULES):
        return None
    self_name = code.co_varnames[0] if code.co_argcount else None
    # Closures read in the user's own code (a library's are its own: transformers' masks).
    users = not in_torch and not any(p in filename for p in INSTALLED)
    frees = frozenset(code.co_freevars)
    paths: dict[tuple[str, ...], int] = {}
    names: dict[tuple[str, ...], int] = {}
    closed_over: dict[str, int] = {}
    off_others: dict[tuple[str, bool], int] = {}
    line = code.co_firstlineno
    instructions = list(dis.get_instructions(code))
    chained: set[int] = set()  # attribute loads that a path off self or a global holds
    for i, instruction in enumerate(instructions):
        line = (instruction.positions and instruction.positions.lineno) or line
        if (name := _global_named(instruction)) is not None and users:  # a library's are its own
            chain = tuple(_attribute_chain(instructions, i + 1))
            chained.update(range(i + 1, i + 1 + len(chain)))
            names.setdefault((name, *chain), line)
        elif _loads_last(instruction) == self_name:
            chain = tuple(_attribute_chain(instructions, i + 1))
            chained.update(range(i + 1, i + 1 + len(chain)))
            path = chain or _named_by_call(instructions, i) or _type_of(instructions, i)
            if path and path[0] not in NOT_READS and not (in_torch and path[0] == "__dict__"):
                paths.setdefault(path, line)
        elif users and instruction.opname == "LOAD_DEREF" and instruction.argval in frees:
            closed_over.setdefault(instruction.argval, line)
        elif users and _loads_last(instruction) is not None:
            for name in _named_by_call(instructions, i):  # getattr(layer, "on", True)
                off_others.setdefault((name, True), line)
        elif users and instruction.opname in _ATTR_LOADS and i not in chained:
            name = instruction.argval  # .scale off a loop variable, an item, a call's result
            name = name[1] if isinstance(name, tuple) else name
            if isinstance(name, str) and name not in NOT_READS:
                off_others.setdefault((name, False), line)
    if not paths and not names and not closed_over and not off_others:
        return None
    return CodeReads(
        self_name,
        tuple(paths.items()),
        tuple(names.items()),
        tuple(closed_over.items()),
        tuple((name, by_call, line) for (name, by_call), line in off_others.items()),
    )


_NAMING_CALLS = frozenset({"getattr", "hasattr"})


def _named_by_call(instructions: Sequence[dis.Instruction], at: int) -> tuple[str, ...]:
    """``(name,)`` where the local loaded at ``at`` is the first argument of ``getattr`` or
    ``hasattr`` with a constant name (``getattr(self, "mult", 1.0)``); else ``()``."""
    if at == 0 or at + 1 >= len(instructions):
        return ()
    before, after = instructions[at - 1], instructions[at + 1]
    if _global_named(before) in _NAMING_CALLS and after.opname == "LOAD_CONST":
        return (after.argval,) if isinstance(after.argval, str) else ()
    return ()


def _global_named(instruction: dis.Instruction) -> str | None:
    """The global an instruction loads (``LOAD_GLOBAL`` may also push a NULL: a pair)."""
    if instruction.opname not in _GLOBAL_LOADS:
        return None
    name = instruction.argval
    return name[-1] if isinstance(name, tuple) and name else name if isinstance(name, str) else None


_CALLS = frozenset({"PRECALL", "CALL"})


def _type_of(instructions: Sequence[dis.Instruction], at: int) -> tuple[str, ...]:
    """``("__class__", name)`` where the local loaded at ``at`` is the argument of ``type``
    and ``name`` is read off the result (``type(self).factor``); ``("__dict__",)`` where it is
    the argument of ``vars``; else ``()``."""
    called = _global_named(instructions[at - 1]) if at else None
    if called not in ("type", "vars"):
        return ()
    if called == "vars":
        return ("__dict__",)
    after = at + 1
    while after < len(instructions) and instructions[after].opname in _CALLS:
        after += 1
    chain = tuple(_attribute_chain(instructions, after))
    return ("__class__", *chain[:1]) if chain else ()


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
