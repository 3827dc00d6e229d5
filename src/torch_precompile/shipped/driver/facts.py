"""The driver part for Python values the traced code read: module attributes and globals
(and attributes of the user's modules and objects held in globals: ``config.SCALE``).

The graph holds each such value as a constant (a LoRA ``scaling``, a dropout ``p``, a global
``SCALE``), so every call must find the same value where the trace read it. A value that is
still the very object the last passing call saw is taken as is (one identity test); anything
else is compared by type and value, and a difference is refused, naming the value, where it
was read and both values.
"""

import operator
import os
import sys
from collections.abc import Sequence
from types import FunctionType, MappingProxyType
from typing import Any

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.encoded import MISSING, compare_read, module_read_name


class PythonFacts:
    """The values a driver's spec says the trace read."""

    def __init__(self, driver: "Driver") -> None:
        spec = driver.spec
        names = [s.name for s in spec.submodules]
        self.module_reads = [
            (r, module_read_name(names[r.submodule], r.path, driver.model.names))
            for r in spec.read_values
            if r.submodule is not None
        ]
        self.globals = GlobalReads(
            [
                GlobalRead(r.module, r.path, r.expected, r.where, r.file)
                for r in spec.read_values
                if r.submodule is None
            ]
        )

    def check_modules(self, submodules: Sequence[Any]) -> None:
        """Every attribute read off a submodule, compared with the captured value."""
        for read, shown in self.module_reads:
            value = submodules[read.submodule]
            for name in read.path:
                value = getattr(value, name, MISSING)
            compare_read(read.expected, read.where, shown, value)

    def module_paths(self) -> list[tuple[int, tuple[str, ...]]]:
        """Where each module attribute was read: (submodule index, attribute path)."""
        return [(read.submodule, tuple(read.path)) for read, _ in self.module_reads]

    def check_globals(self) -> None:
        self.globals.check()


class GlobalReads:
    """The globals the trace read (``reads``), checked at every call. The path to each value
    is remembered while nothing can have changed in place: a call that finds the same objects
    there checks nothing more."""

    def __init__(self, reads: Sequence["GlobalRead"]) -> None:
        self.reads = list(reads)
        self.dicts: list[Any] = []
        self.names: list[str] = []
        self.seen: list[Any] = []
        self.settled = not self.reads

    def check(self) -> None:
        """The globals read, where their module is loaded in this process."""
        if self.settled and all(
            map(operator.is_, map(dict.get, self.dicts, self.names), self.seen)
        ):
            return
        dicts, names, seen = [], [], []
        settled = True
        for read in self.reads:
            holder: Any = read.namespace()
            if holder is None:
                settled = settled and read.never_here
                continue
            # Each step of the path (config, then config.SCALE) is remembered, so that the
            # next call sees a rebound config as surely as a changed SCALE.
            value: Any = None
            for name in read.path:
                if name == "__closure__" and type(value) is FunctionType:
                    holder = _Cells(value)  # the next name is one of its closure variables
                    continue
                if holder is os.environ:  # None where a variable is unset
                    value, settled = holder.get(name), False
                elif type(holder) is not dict:  # a class's namespace, slots: not remembered
                    value, settled = holder.get(name, MISSING), False
                else:
                    value = holder.get(name, MISSING)
                    dicts.append(holder)
                    names.append(name)
                    seen.append(value)
                holder = value if value is os.environ else getattr(value, "__dict__", None)
                if not isinstance(holder, dict | MappingProxyType) and holder is not os.environ:
                    holder = _Attributes(value)  # an object with slots
            compare_read(read.expected, read.where, read.shown, value)
            settled = settled and _fixed(read.expected)  # a list, set, ... changes in place
        self.dicts, self.names, self.seen = dicts, names, seen
        self.settled = settled


class GlobalRead:
    """A global the traced code read: off module ``module`` (by name; ``file``: the script's
    base name where it is ``__main__``), the attribute ``path``, its ``expected`` value
    (encoded) and ``where`` it was read."""

    def __init__(
        self,
        module: str,
        path: Sequence[str],
        expected: Any,
        where: str,
        file: str | None = None,
    ) -> None:
        self.module, self.path, self.expected, self.where, self.file = (
            module,
            tuple(path),
            expected,
            where,
            file,
        )
        environment = module == "os" and self.path[0] == "environ"
        function, cells, closed = _split(self.path, "__closure__")
        self.shown = (
            f"environment variable {self.path[1]!r}"
            if environment
            else f"closure variable {'.'.join(closed)!r} of {'.'.join(function)} (module {module})"
            if cells
            else f"global {'.'.join(self.path)!r} of module {module}"
        )
        self.never_here = False

    def namespace(self) -> dict[str, Any] | None:
        """The module's globals; None where it is not loaded (or ``__main__`` is another
        script), so nothing in this process can have changed the value."""
        module = sys.modules.get(self.module)
        if module is None:
            return None
        if self.module == "__main__" and _base_name(getattr(module, "__file__", None)) != self.file:
            self.never_here = True
            return None
        return vars(module)


class _Cells:
    """A function's closure variables looked up by name (MISSING for an empty cell)."""

    def __init__(self, function: FunctionType) -> None:
        self.function = function

    def get(self, name: str, default: Any) -> Any:
        names = self.function.__code__.co_freevars
        if name not in names:
            return default
        cells = self.function.__closure__ or ()
        try:
            return cells[names.index(name)].cell_contents
        except ValueError:  # a cell not yet filled
            return default


class _Attributes:
    """An object's attributes looked up by name, for an object without an instance dict."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self, name: str, default: Any) -> Any:
        return getattr(self.value, name, default)


def _split(path: tuple[str, ...], step: str) -> tuple[tuple[str, ...], bool, tuple[str, ...]]:
    """``path`` before and after its first ``step``, and whether it holds one."""
    if step not in path:
        return path, False, ()
    at = path.index(step)
    return path[:at], True, path[at + 1 :]


def _fixed(encoded: Any) -> bool:
    """Whether a value encoded so cannot change in place: it holds no list, dict, set or
    NumPy array (a named tuple or tuple holding one can), and is no function compared by its
    closure values (a cell can be set anew)."""
    kind, value = encoded
    if kind in ("list", "dict", "set", "ndarray", "object", "code"):
        return False
    if kind in ("tuple", "frozenset"):
        return all(map(_fixed, value))
    if kind == "frozen":
        return all(_fixed(item) for _, item in value[1])
    return True


def _base_name(file: Any) -> str | None:
    return file.rsplit("/", 1)[-1].rsplit("\\", 1)[-1] if isinstance(file, str) else None
