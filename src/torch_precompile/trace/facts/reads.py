"""Python values the traced code read: each becomes a check the artifact runs at every call.

A trace records tensor operations; a module attribute (``self.scaling``) or a module global
(``SCALE``) that the code multiplies by is baked into the graph as a number. So while ``fn`` is
traced, every Python function entered is looked at once: the attribute paths it reads off its
first argument when that is one of the model's submodules (``self.p``, ``self.config.eps``, a
class attribute of the user's ``self.factor``) and, in the user's own code (a library's globals
are its own), the globals it names, followed into attributes of the user's own modules and
plain objects and classes (``config.SCALE``, ``Settings.SCALE``), and of modules held in
globals (a global ``criterion``'s ``self.label_smoothing``). Those holding plain values
(numbers, strings, bools, None, enum members, dtypes, functions, tuples, lists, dicts, sets and
named tuples of such, NumPy scalars and small arrays) are recorded with the value they had; the
driver compares them at every call. A path that ends on an object (``c = self.config``,
``helper(x, self.config)``) records every plain value the object holds, since what is read off
it later is out of sight; so does a method called on a plain object (``self.helper.apply(x)``),
and ``vars(self)`` records the instance's; an object of the user's in a list, tuple or dict
read is recorded in it by its class and values. An attribute name read off anything but
``self`` (``layer.scale`` in ``for layer in self.layers``, ``self.block.scale``) is recorded
on every submodule below the module whose code reads it that holds a value under it.
``hasattr(self, "x")`` or ``getattr(self, "x", default)`` of an attribute the module lacks
records it as absent; ``type(self).x`` and a classmethod's ``cls.x`` read the class. Reads
are found by reading each function's bytecode, so a name used only in a branch the trace did
not take is checked too (a stricter check, never a missed one). A value ``fn`` closes over
is read through the global of its module that holds ``fn``, where one does
(``step.__closure__.scale``). Values held elsewhere (a closure cell of ``fn`` held by no
global, the object a bound method ``fn`` belongs to, an object passed in) are the caller's to
keep: capture names those it saw read (``closure_report``); see docs/CONTRACT.md.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torch_precompile.internals.tracing import TorchDispatchMode, dispatch_modes
from torch_precompile.shipped.driver.encoded import shown_value
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.spec import EncodedValue, ReadValue
from torch_precompile.trace.facts.call_watch import CallWatch
from torch_precompile.trace.facts.code_homes import (
    PACKAGE_ROOT,
    TORCH_ROOT,
    function_home,
    global_holding,
    in_standard_library,
    runs_as,
    runs_as_function,
    script_name,
    torch_own,
    users_file,
)
from torch_precompile.trace.facts.code_reads import NOT_READS, CodeReads, code_reads
from torch_precompile.trace.facts.environment import ENVIRONMENT_READS
from torch_precompile.trace.facts.output_calls import OUTPUT_CALLS
from torch_precompile.trace.facts.read_values import (
    closure_cells,
    is_closure_constant,
    is_followed,
    object_values,
)
from torch_precompile.trace.values import UNSEEN, Use, encode, held_values, is_plain_object


class OperatorsUnwatched(TorchDispatchMode):
    """Runs torch's own operators on torch's own tensors with the call watch paused: their
    Python (fake tensors, decompositions, the tracer) is most of a trace's time and reads
    nothing of the user's, and on Python 3.11 a watch makes every frame slower. Other
    operators (a custom op's Python, a tensor subclass's dispatch, a control-flow operator's
    functions) run watched."""

    supports_higher_order_operators = True

    def __init__(self, watch: CallWatch) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.watch = watch

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (
            getattr(func, "namespace", None) not in _TORCH_NAMESPACES
            or not all(map(torch_own, types))
            or not self.watch.pause()
        ):
            return func(*args, **(kwargs or {}))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.watch.resume()


_TORCH_NAMESPACES = frozenset(("aten", "prims", "_c10d_functional", "c10d"))


class ReadRecorder:
    """While active (``with``), records the plain values the Python code it sees reads.

    ``submodules`` are the model arguments' modules in walk order (their index is how a read
    names its module). Runs beside any tracer already installed (a debugger, coverage).
    """

    def __init__(self, submodules: Sequence[torch.nn.Module]) -> None:
        self.index = {id(m): i for i, m in enumerate(submodules)}
        # Each model class by its first module: a classmethod's reads name that module.
        self.class_index: dict[int, int] = {}
        for i, m in enumerate(submodules):
            self.class_index.setdefault(id(type(m)), i)
        self.submodules = submodules
        self.code_reads: dict[types.CodeType, CodeReads | None] = {}
        self.reads: dict[tuple[Any, ...], ReadValue] = {}
        self.namespaces: dict[str, dict[str, Any]] = {}  # where each global was read
        # Modules held in globals, not the model's (a loss: ``criterion``), and the object fn
        # belongs to where a global holds it: where each is.
        self.global_modules: dict[int, tuple[dict[str, Any], str]] = {}
        self.watch: CallWatch | None = None
        self.unwatched: OperatorsUnwatched | None = None
        # Plain values read from closures (fn's own, a helper's): no call can reach them, so
        # capture names them (``closure_report``). Keyed by code and name; shown with where.
        self.closed_over: dict[tuple[Any, ...], str] = {}
        self.closure_modules: dict[int, str] = {}  # modules fn closes over (a criterion)
        # Objects fn itself holds (a bound method's self, a callable object), by label: what
        # their methods read off them is named too, as closure values are.
        self.held_objects: dict[int, str] = {}
        self.read_off_held = False  # whether a value read off one is named
        # fn's code, and the globals and name through which a call finds fn again: the values
        # it closes over are read through that global (``step.__closure__.scale``).
        self.home: tuple[types.CodeType, dict[str, Any], str] | None = None
        self.fn_code: types.CodeType | None = None
        # Functions with closures the user's code read as globals, by code: (globals, name,
        # function). A helper's closure is read through the one whose cells its frame sees.
        self.global_functions: dict[types.CodeType, list[tuple[dict[str, Any], str, Any]]] = {}
        self.clocks: dict[str, str] = {}  # clock functions the user's code names, and where
        # print, logging and warnings.warn calls the user's code made, by where: "print".
        self.output_calls: dict[str, str] = {}

    def hold(self, fn: Callable[..., Any]) -> None:
        """Note where a call finds what ``fn`` holds: the object it belongs to (``runs_as``)
        through the global of its class's module that holds it (else no call can reach it:
        its values are named), and fn's closure through the global that holds fn."""
        owner = runs_as(fn)
        if owner is not None:
            namespace = vars(sys.modules[type(owner).__module__])
            name = global_holding(namespace, owner)
            if name is not None:  # a trainer's ``self.scale`` is ``TRAINER.scale``
                self.global_modules.setdefault(id(owner), (namespace, name))
            else:
                self.held_objects[id(owner)] = type(owner).__name__
        self.home = function_home(fn)
        function = runs_as_function(fn)
        self.fn_code = getattr(function, "__code__", None)

    def __enter__(self) -> ReadRecorder:
        # Garbage-collection callbacks run inside any allocation; what they read is theirs.
        for callback in gc.callbacks:
            self.code_reads[getattr(callback, "__code__", None)] = None  # type: ignore[index]
        self.watch = CallWatch(self.code_reads, code_reads, self._look).__enter__()
        if self.watch.tracer is not None and all(  # (sys.monitoring costs nothing kept on)
            torch_own(type(mode)) for mode in dispatch_modes()
        ):  # a mode of the user's below would run its Python unwatched
            self.unwatched = OperatorsUnwatched(self.watch)
            self.unwatched.__enter__()  # type: ignore[no-untyped-call]  # torch's, unannotated
        ENVIRONMENT_READS.enter(self._environment_read)
        OUTPUT_CALLS.enter(self._output_call)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.unwatched is not None:
            self.unwatched.__exit__(*exc)  # type: ignore[no-untyped-call]
            self.unwatched = None
        if self.watch is not None:
            self.watch.__exit__()
        ENVIRONMENT_READS.exit(self._environment_read)
        OUTPUT_CALLS.exit(self._output_call)

    def _output_call(self, what: str, frame: types.FrameType) -> None:
        """A print, logging or warnings.warn call: noted where the user's code made it."""
        file = frame.f_code.co_filename
        if users_file(file) and not file.startswith("<frozen"):
            where = f"{Path(file).name}:{frame.f_lineno} ({frame.f_code.co_name})"
            self.output_calls.setdefault(where, what)

    def _environment_read(self, name: str, value: str | None, frame: types.FrameType) -> None:
        """A variable the user's code read from ``os.environ``: a global read of it."""
        file = frame.f_code.co_filename
        key = ("global", "os", ("environ", name))
        if key in self.reads or file.startswith((TORCH_ROOT, PACKAGE_ROOT)):
            return
        if in_standard_library(file) or (file.startswith("<") and "<ipython" not in file):
            return
        where = f"{Path(file).name}:{frame.f_lineno} ({frame.f_code.co_name})"
        self.namespaces["os"] = vars(os)
        expected = encode(value, Use.READ)  # a str, or None where unset: always encoded
        assert expected is not None
        self.reads[key] = ReadValue(None, "os", key[2], expected, where)

    def _look(self, frame: types.FrameType) -> None:
        code = frame.f_code
        reads = self.code_reads.get(code, UNSEEN)
        if reads is UNSEEN:
            reads = self.code_reads[code] = code_reads(code)
        if reads is None:
            return
        where = f"{Path(code.co_filename).name}:{{}} ({code.co_name})"
        owner = frame.f_locals.get(reads.self_name) if reads.self_name else None
        if reads.off_others and isinstance(owner, torch.nn.Module) and id(owner) in self.index:
            self._read_off_submodules(owner, reads.off_others, where)
        if reads.paths:
            index = self.index.get(id(owner))
            if index is None and isinstance(owner, type):  # a classmethod's ``cls``
                index = self.class_index.get(id(owner))
                reads = CodeReads(
                    reads.self_name,
                    tuple((("__class__", *p), line) for p, line in reads.paths),
                    reads.globals,
                    reads.closed_over,
                )
            held = self.global_modules.get(id(owner))
            enclosed = self.closure_modules.get(id(owner))
            for path, line in reads.paths:
                if index is not None:
                    self._module_read(index, path, where.format(line))
                elif held is not None:  # a global criterion's ``self.label_smoothing``
                    self._global_read(held[0], (held[1], *path), where.format(line))
                elif enclosed is not None:  # a criterion fn closes over: only named
                    self._name_closed_over(owner, enclosed, path, where.format(line))
                elif id(owner) in self.held_objects:  # a trainer's ``self.scale``
                    label = self.held_objects[id(owner)]
                    self._name_closed_over(owner, label, path, where.format(line))
                    self.read_off_held = True
        for path, line in reads.globals:
            self._global_read(frame.f_globals, path, where.format(line))
            if _reads_clock(frame.f_globals, path):
                self.clocks.setdefault(".".join(path), where.format(line))
        holder = self._holder(frame) if reads.closed_over else None
        for name, line in reads.closed_over:
            value = frame.f_locals.get(name)
            if isinstance(value, torch.nn.Module) and id(value) not in self.index:
                self.closure_modules.setdefault(id(value), name)  # its reads are named too
            elif holder is not None:  # a call reads it through the global holding the function
                namespace, function = holder
                self._global_read(namespace, (function, "__closure__", name), where.format(line))
            elif (code, name) not in self.closed_over and is_closure_constant(value):
                if self._checked_code(frame, code):
                    continue  # a helper read as a global: its digest holds its plain cells
                self.closed_over[code, name] = f"{name}={value!r} ({where.format(line)})"
            elif (code, name) not in self.closed_over and is_plain_object(value):
                # What fn reads off an object of the user's is out of sight: each plain value
                # it holds is named (``setting.scale=3.0``).
                for inner, encoded in object_values(value):
                    shown = f"{'.'.join((name, *inner))}={shown_value(encoded)}"
                    self.closed_over[code, name, inner] = f"{shown} ({where.format(line)})"

    def _holder(self, frame: types.FrameType) -> tuple[dict[str, Any], str] | None:
        """The globals, and the name there, through which a call finds the function running
        ``frame``: fn's own (``function_home``), or the one function the user's code read as
        a global whose code this is and whose cells hold what the frame sees (``HELPER``)."""
        code = frame.f_code
        if code is self.fn_code:
            return None if self.home is None else (self.home[1], self.home[2])
        seen = frame.f_locals
        found = [
            (namespace, name)
            for namespace, name, function in self.global_functions.get(code, ())
            if all(seen.get(v, UNSEEN) is c for v, c in closure_cells(function).items())
        ]
        return found[0] if len(found) == 1 else None  # two alike: which one ran is unknown

    def _checked_code(self, frame: types.FrameType, code: types.CodeType) -> bool:
        """Whether ``code`` is that of a function read as a global by its code and plain
        closure values (kind ``code``), which every call compares."""
        qualified = f"{frame.f_globals.get('__name__')}.{code.co_qualname}"
        return any(
            r.expected[0] == "code" and r.expected[1][0] == qualified for r in self.reads.values()
        )

    def _name_closed_over(self, owner: Any, label: str, path: tuple[str, ...], where: str) -> None:
        """Name the plain value at ``path`` off ``owner`` (``label`` in the report)."""
        value = _value_at(owner, path)
        if (id(owner), path) not in self.closed_over and is_closure_constant(value):
            shown = f"{'.'.join((label, *path))}={value!r}"
            self.closed_over[id(owner), path] = f"{shown} ({where})"

    def _read_off_submodules(
        self, owner: torch.nn.Module, reads: Sequence[tuple[str, bool, int]], where: str
    ) -> None:
        """Attribute names read in a method of ``owner`` off something other than ``self``
        (``for layer in self.layers:`` then ``layer.scale`` or ``getattr(layer, "on", True)``;
        ``self.layers[0].scale``; ``self.block.scale``): which submodule that was is out of
        sight, so each submodule below ``owner`` holding a value under the name has it read
        (and, for getattr and hasattr, each lacking one has it read as absent)."""
        for module in owner.modules():
            index = self.index.get(id(module))
            if module is owner or index is None:
                continue
            for name, by_call, line in reads:
                held = vars(module).get(name, UNSEEN)
                # A plain value only: an object or a tensor under a common name is no setting.
                if (by_call and held is UNSEEN) or encode(held, Use.READ) is not None:
                    self._module_read(index, (name,), where.format(line))

    def _module_read(self, index: int, path: tuple[str, ...], where: str) -> None:
        key = ("module", index, path)
        if key in self.reads:
            return
        module = self.submodules[index]
        if path[0] == "__class__":  # ``type(self).factor``, ``cls.factor``: the class's value
            own = len(path) > 1 and not path[1].startswith("__")  # not __name__, __module__
            found = _class_value(type(module), path[1]) if own else UNSEEN
            encoded = None if found is UNSEEN else encode(found, Use.READ)
            if encoded is not None:
                self.reads[key] = ReadValue(index, None, path[:2], encoded, where)
            return
        namespace: Mapping[str, Any] = vars(module)
        if path[0] == "__dict__":  # ``self.__dict__["s"]``, ``vars(self)``: every plain value
            for name, value in namespace.items():
                encoded = encode(value, Use.READ)
                if encoded is not None and name not in NOT_READS:
                    found = ("module", index, (name,))
                    self.reads.setdefault(found, ReadValue(index, None, (name,), encoded, where))
            return
        for depth, name in enumerate(path):
            if name in namespace:
                value = namespace[name]
            elif depth == 0 and (found := _class_value(type(module), name)) is not UNSEEN:
                value = found  # ``factor = 2.0`` in the class body, read as ``self.factor``
            elif depth == 0 and (method := _users_method(type(module), name)) is not None:
                # ``self.helper(x)``: the graph holds what the method computed, so one set
                # on the instance or patched into the class later would go unseen.
                named: EncodedValue = ("callable", qualified_name(method))
                self.reads[key] = ReadValue(index, None, path[:1], named, where)
                return
            elif depth == 0 and len(path) > 1 and (child := _child(module, name)) is not None:
                if id(child) in self.index:  # ``self.block.scale``: the submodule's own value
                    self._module_read(self.index[id(child)], path[1:], where)
                return
            elif depth == 0 and _absent(module, name):
                # ``if hasattr(self, "scale")``, ``getattr(self, "mult", 1.0)``: one set
                # later would take the other branch.
                self.reads[key] = ReadValue(index, None, path[:1], ("absent", None), where)
                return
            elif depth == 0:
                return  # a parameter, buffer, submodule, torch's method, a property
            else:
                # A method or class value of a plain object (``self.helper.compute(x)``): what
                # it reads off the object is out of sight, so the object is read whole.
                path = path[:depth]
                break
            encoded = encode(value, Use.READ)
            if encoded is not None:
                self.reads[key] = ReadValue(index, None, path[: depth + 1], encoded, where)
                return
            if not is_plain_object(value):
                return
            namespace = held_values(value)
        # The path ends on an object (``cfg = self.cfg``, ``helper(x, self.cfg)``): what is
        # read off it later is not in this code, so every plain value it holds is recorded.
        for inner, encoded in object_values(value):
            key = ("module", index, (*path, *inner))
            self.reads.setdefault(key, ReadValue(index, None, key[2], encoded, where))

    def _global_read(self, namespace: dict[str, Any], path: tuple[str, ...], where: str) -> None:
        """Record the global ``path[0]``, or the first plain value on ``path`` off it where
        it is one of the user's modules or a plain object (``config.SCALE``)."""
        module = namespace.get("__name__")
        if path[0] not in namespace or not isinstance(module, str):
            return
        value = namespace[path[0]]
        if isinstance(value, torch.nn.Module) and id(value) not in self.index:
            self.global_modules.setdefault(id(value), (namespace, path[0]))
        if type(value) is types.FunctionType and value.__closure__:
            held = self.global_functions.setdefault(value.__code__, [])
            if all(f is not value for _, _, f in held):
                held.append((namespace, path[0], value))
        for depth, name in enumerate(path):
            if path[depth + 1 : depth + 2] == ("__closure__",) or name == "__closure__":
                if not isinstance(value, types.FunctionType):
                    return
                continue  # a function whose closure variable is read: that value is checked
            if depth and path[depth - 1] == "__closure__":
                holder = closure_cells(value)
            elif depth:
                followed = is_followed(value) or id(value) in self.global_modules
                holder = held_values(value) if followed else {}
                if name not in holder and is_plain_object(value):
                    path = path[:depth]  # a method of a plain object: the object read whole
                    break
            if depth:
                if name not in holder:
                    return
                value = holder[name]
            key = ("global", module, path[: depth + 1])
            if key in self.reads:
                return
            encoded = encode(value, Use.READ)
            if encoded is not None:
                self.namespaces[module] = namespace
                self.reads[key] = ReadValue(
                    None, module, path[: depth + 1], encoded, where, script_name(module, namespace)
                )
                return
        if not is_plain_object(value):
            return
        self.namespaces[module] = namespace
        script = script_name(module, namespace)
        for inner, encoded in object_values(value):  # a global object read whole
            key = ("global", module, (*path, *inner))
            self.reads.setdefault(key, ReadValue(None, module, key[2], encoded, where, script))

    def closure_report(self) -> str | None:
        """What the traced code read from closures, said once; None where it read nothing."""
        if not self.closed_over:
            return None
        values = list(self.closed_over.values())
        more = f" and {len(values) - 4} more" if len(values) > 4 else ""
        held = " or holds (the object it is a method of)" if self.read_off_held else ""
        return (
            f"fn reads values it closes over{held}: {', '.join(values[:4])}{more}. The "
            "artifact holds them as they are now and no call can reach them to check; pass a "
            "value that may change as an argument of fn, or hold it (or the module that "
            "holds it, a loss) in a global or a model argument: then every call checks it."
        )

    def clock_report(self) -> str | None:
        """The clock reads of the traced code, said once; None where it read no clock."""
        if not self.clocks:
            return None
        reads = ", ".join(f"{name} ({where})" for name, where in self.clocks.items())
        return (
            f"fn reads the clock: {reads}. A number it gave becomes a constant of the graph "
            "(a duration fn returns would be the capture's at every call); time the call "
            "outside fn."
        )

    def output_report(self, tracer: str) -> str | None:
        """The print, logging and warnings.warn calls of the traced code, said once; None
        where it made none. The make_fx tracer warns of them; under Dynamo, whose reading of
        fn would not carry them either, they are refused."""
        if not self.output_calls:
            return None
        calls = [f"{what} ({where})" for where, what in self.output_calls.items()]
        listed = ", ".join(calls[:6]) + (f" and {len(calls) - 6} more" if len(calls) > 6 else "")
        if tracer == "dynamo":
            return (
                f"tracer='dynamo' refuses what fn prints, logs or warns: {listed}. Each would "
                "run once, at capture, and never at a call of the artifact: move it out of fn, "
                "around the artifact's call, or capture with tracer='make_fx' (the default), "
                "which runs it once at capture and warns of it."
            )
        return (
            f"fn prints, logs or warns: {listed}. Each ran once, at capture, and will not run "
            "at a call of the artifact, which runs the graph alone; move it outside fn, around "
            "the artifact's call."
        )

    def records(self) -> tuple[ReadValue, ...]:
        """Every read, modules' attributes first (in walk order), then globals."""
        return tuple(
            sorted(
                self.reads.values(),
                key=lambda r: (r.submodule is None, r.submodule or 0, r.module or "", r.path),
            )
        )


def _class_value(cls: type, name: str) -> Any:
    """The plain value a class of the user's (not one of torch's) holds under ``name``, as an
    instance without its own reads it; ``UNSEEN`` for anything else (methods, properties,
    descriptors, torch's own class constants)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            user_class = not klass.__module__.startswith(("torch.", "builtins"))
            descriptor = hasattr(type(value), "__get__")
            return value if user_class and not descriptor else UNSEEN
    return UNSEEN


def _child(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The submodule ``module`` registered as ``name``, if any (no property is run)."""
    return dict(module.named_children()).get(name)


def _absent(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module`` has nothing under ``name``: no attribute, member or class value."""
    held = vars(module)
    members = (held.get(kind, {}) for kind in ("_parameters", "_buffers", "_modules"))
    return (
        name not in held
        and not any(name in m for m in members)
        and not any(name in vars(klass) for klass in type(module).__mro__)
    )


def _users_method(cls: type, name: str) -> types.FunctionType | None:
    """The method ``name`` of ``cls`` where a class of the user's own code defines it (not
    torch, an installed package or the standard library, whose methods are theirs)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            module = sys.modules.get(klass.__module__)
            file = getattr(module, "__file__", None)
            own = isinstance(file, str) and users_file(file)
            return value if own and isinstance(value, types.FunctionType) else None
    return None


_CLOCKS = (
    *(time.time, time.time_ns, time.perf_counter, time.perf_counter_ns, time.monotonic),
    *(time.monotonic_ns, time.process_time, time.process_time_ns, time.thread_time),
)
_DATETIME_NOW = frozenset({"now", "utcnow", "today"})


def _reads_clock(namespace: dict[str, Any], path: Sequence[str]) -> bool:
    """Whether the global ``path`` names a clock: ``time.time``, ``perf_counter`` imported
    from time, ``datetime.now``."""
    value, rest = namespace.get(path[0]), list(path[1:])
    if value is datetime and rest:  # datetime.datetime.now
        value = getattr(datetime, rest.pop(0), None)
    if value is datetime.datetime or value is datetime.date:
        return bool(rest) and rest[0] in _DATETIME_NOW
    if value is time and rest:
        value = getattr(time, rest[0], None)
    return any(value is clock for clock in _CLOCKS)  # by identity: globals may be arrays


def _value_at(owner: Any, path: Sequence[str]) -> Any:
    """The value at the attribute ``path`` off ``owner``, through instance dicts only (no
    property runs); ``UNSEEN`` where there is none."""
    value = owner
    for name in path:
        value = getattr(value, "__dict__", {}).get(name, UNSEEN)
    return value


def drop_changed_reads(recorder: ReadRecorder) -> None:
    """Forget the values fn itself set while it was traced (a config field filled in on the
    first call, as transformers' classifiers set ``problem_type``): before the call they hold
    one value and after it another, so no single value is the one to insist on. Attributes of
    the model's modules that fn changes are refused by ``python_state``."""
    for key, read in list(recorder.reads.items()):
        if read.submodule is None:
            value = recorder.namespaces[read.module or ""].get(read.path[0])
            function = None  # a function whose closure variable the next name is
            for name in read.path[1:]:
                if name == "__closure__" and isinstance(value, types.FunctionType):
                    function = value
                elif function is not None:
                    value, function = closure_cells(function).get(name), None
                else:
                    value = value.get(name) if value is os.environ else getattr(value, name, None)
        else:
            value = recorder.submodules[read.submodule]
            for name in read.path:
                value = getattr(value, name, UNSEEN)
        now = ("absent", None) if value is UNSEEN else encode(value, Use.READ)
        if now != read.expected:
            del recorder.reads[key]
