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
from typing import Any

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.encoded import MISSING, compare_read, module_read_name


class PythonFacts:
    """The values a driver's spec says the trace read."""

    def __init__(self, driver: Driver) -> None:
        spec = driver.spec
        names = [s.name for s in spec.submodules]
        self.module_reads = [
            (r, module_read_name(names[r.submodule], r.path))
            for r in spec.read_values
            if r.submodule is not None
        ]
        self.global_reads = [GlobalRead(r) for r in spec.read_values if r.submodule is None]
        self.global_dicts: list[Any] = []
        self.global_names: list[str] = []
        self.global_seen: list[Any] = []
        self.globals_settled = not self.global_reads

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
        """The globals read, where their module is loaded in this process."""
        if self.globals_settled and all(
            map(operator.is_, map(dict.get, self.global_dicts, self.global_names), self.global_seen)
        ):
            return
        dicts, names, seen = [], [], []
        settled = True
        for read in self.global_reads:
            holder: Any = read.namespace()
            if holder is None:
                settled = settled and read.never_here
                continue
            # Each step of the path (config, then config.SCALE) is remembered, so that the
            # next call sees a rebound config as surely as a changed SCALE.
            for name in read.record.path:
                if not isinstance(holder, dict):  # os.environ: None where a name is unset
                    value, settled = holder.get(name), False
                else:
                    value = holder.get(name, MISSING)
                    dicts.append(holder)
                    names.append(name)
                    seen.append(value)
                holder = value if value is os.environ else getattr(value, "__dict__", None)
                if not isinstance(holder, dict) and holder is not os.environ:
                    holder = {}
            compare_read(read.record.expected, read.record.where, read.shown, value)
            settled = settled and type(value) not in (list, dict)  # it can change in place
        self.global_dicts, self.global_names, self.global_seen = dicts, names, seen
        self.globals_settled = settled


class GlobalRead:
    """A global read by the traced code, and where to find its module at a call."""

    def __init__(self, record: Any) -> None:
        self.record = record
        environment = record.module == "os" and record.path[0] == "environ"
        self.shown = (
            f"environment variable {record.path[1]!r}"
            if environment
            else f"global {'.'.join(record.path)!r} of module {record.module}"
        )
        self.never_here = False

    def namespace(self) -> dict[str, Any] | None:
        """The module's globals; None where it is not loaded (or ``__main__`` is another
        script), so nothing in this process can have changed the value."""
        module = sys.modules.get(self.record.module)
        if module is None:
            return None
        if (
            self.record.module == "__main__"
            and _base_name(getattr(module, "__file__", None)) != self.record.file
        ):
            self.never_here = True
            return None
        return vars(module)


def _base_name(file: Any) -> str | None:
    return file.rsplit("/", 1)[-1].rsplit("\\", 1)[-1] if isinstance(file, str) else None
