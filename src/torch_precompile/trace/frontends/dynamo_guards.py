"""``tracer="dynamo"``: what Dynamo read of ``fn``'s Python, made into the artifact's checks.

Dynamo reads ``fn``'s bytecode (and that of every function it calls) and guards each fact the
code depended on. The graph still comes from the make_fx trace (a whole step, backward and
optimizer included); Dynamo is a second reader beside it. Each guard becomes one of:

- **checked**: a check the artifact runs at every call holds it. A global, or an attribute
  of a submodule, that the make_fx trace did not record becomes a read value of its own.
- **fixed**: it cannot differ at a call of this artifact (torch's own code, pinned by the
  torch build the artifact insists on; a value fn computed before a graph break).
- **dropped**: no call can reach it (a value ``fn`` closes over, the object ``fn`` is a
  method of, where no global of the user's module holds ``fn`` or that object); said at
  capture, listed by ``inspect``, refused under ``require_all_guards=True``. Where a global
  holds them, a call finds them by that name: ``fn``'s closure values (and those of the
  functions it calls) and the object's attributes are read values of that global.

A graph break is carried where the make_fx trace covers what Dynamo could not read
(``loss.backward()``, a value read off a tensor, which the trace checks at every call) and
refused otherwise, naming the user's line and Dynamo's reason.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import types
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import dynamo
from torch_precompile.internals.origin import shown_path
from torch_precompile.spec import GuardNote, ReadValue
from torch_precompile.trace.facts.code_homes import script_name, users_file
from torch_precompile.trace.frontends.dynamo_breaks import break_line, carried, resumes
from torch_precompile.trace.frontends.guard_paths import (
    MISSING,
    attribute_names,
    below,
    cells_named,
    covers,
    is_code,
    is_object,
    shown_briefly,
    users_module,
    walk,
    walk_from,
)
from torch_precompile.trace.values import Use, encode, encode_object

log = logging.getLogger("torch_precompile")


CHECKED, FIXED, DROPPED = "checked", "fixed", "dropped"
# Torch's thread state, and the artifact's check that insists on the capture's.
_STATE_CHECKS = {
    "GRAD_MODE": (CHECKED, "grad mode (a variant per mode; results' history)"),
    "GLOBAL_STATE": (CHECKED, "ambient state (grad mode, autocast)"),
    "DETERMINISTIC_ALGORITHMS": (CHECKED, "ambient state (deterministic algorithms)"),
    "DEFAULT_DEVICE": (CHECKED, "ambient state (torch function modes: a default device)"),
    "TORCH_FUNCTION_STATE": (CHECKED, "ambient state (torch function modes)"),
    "TORCH_FUNCTION_MODE_STACK": (CHECKED, "ambient state (torch function modes)"),
    "SHAPE_ENV": (CHECKED, "input shapes (static sizes; dynamic dims and their relations)"),
    "AUTOGRAD_SAVED_TENSORS_HOOKS": (
        FIXED,
        "the artifact's graphs save their own tensors; saved-tensor hooks change where they "
        "live, not the values computed",
    ),
}
_HOOK_DICTS = frozenset(
    {
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
    }
)


_STRUCTURE = frozenset({"_parameters", "_buffers", "_modules", "__dict__", "forward"})


@dataclass(frozen=True)
class Anchors:
    """The objects of this call the artifact already checks, by identity: submodules (by walk
    index), model tensors and input tensors (by name), optimizers and fn's other arguments."""

    submodules: dict[int, int]
    tensors: dict[int, str]
    optimizers: dict[int, str]
    arguments: dict[str, Any]  # fn's own arguments by name

    @staticmethod
    def of(
        submodules: Sequence[torch.nn.Module],
        tensors: Sequence[tuple[str, torch.Tensor]],
        optimizers: Sequence[tuple[str, Any]],
        arguments: dict[str, Any],
    ) -> Anchors:
        return Anchors(
            {id(m): i for i, m in reversed(list(enumerate(submodules)))},
            {id(t): name for name, t in tensors},
            {id(o): name for name, o in optimizers},
            arguments,
        )


@dataclass(frozen=True)
class Translated:
    """What Dynamo's reading adds to a capture: read values beyond the make_fx trace's, and
    the report of every guard."""

    reads: tuple[ReadValue, ...]
    notes: tuple[GuardNote, ...]

    @property
    def dropped(self) -> list[GuardNote]:
        return [n for n in self.notes if n.outcome == DROPPED]


def read_with_dynamo(fn: Callable[..., Any], args: tuple[Any, ...]) -> dynamo.DynamoReading:
    """Run fn once under Dynamo (the caller puts back whatever it changed)."""
    target, args = _as_function(fn, args)
    try:
        reading, _ = dynamo.read(target, args, _note)
    except dynamo.DynamoFailed as error:
        raise PrecompileError(
            f"tracer='dynamo' could not read fn: {error}. Capture with tracer='make_fx' (the "
            "default) instead."
        ) from None
    return reading


def _note(globals_: dict[str, Any], arguments: dict[str, Any], path: dynamo.GuardPath) -> Any:
    """A guarded place's plain value as Dynamo read it, before the frame ran (encoded: a list
    fn then changes in place is seen as it was)."""
    frame = dynamo.FrameRead(_NO_CODE, globals_, arguments, ())
    try:
        return encode(walk(frame, path)[-1], Use.READ)
    except Exception:  # a value whose encoding fails is no plain value
        return None


def _as_function(fn: Any, args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``fn`` as a plain function or bound method and its arguments, so that the first frame
    Dynamo translates is ``fn``'s own code (it wraps other callables in a frame of its own): a
    partial's function with its bound arguments, a module's ``forward`` or a callable
    object's ``__call__`` with the object as ``self``."""
    while isinstance(fn, functools.partial) and not fn.keywords:
        fn, args = fn.func, (*fn.args, *args)
    if isinstance(fn, types.FunctionType | types.MethodType):
        return fn, args
    method = type(fn).forward if isinstance(fn, torch.nn.Module) else type(fn).__call__
    return method, (fn, *args)


def code_of(fn: Callable[..., Any]) -> types.CodeType:
    """The code of the frame Dynamo enters first for ``fn`` (see ``_as_function``)."""
    target, _ = _as_function(fn, ())
    target = getattr(target, "__func__", target)
    return cast(types.CodeType, getattr(target, "__code__", None))


def translate(
    reading: dynamo.DynamoReading,
    fn: Callable[..., Any],
    anchors: Anchors,
    made: Sequence[ReadValue],
) -> Translated:
    """Each guard of each frame Dynamo read, as a check, a fixed fact or a dropped guard."""
    fn_code = code_of(fn)
    if not any(f.code is fn_code or resumes(f.code, fn_code) for f in reading.frames):
        why = f": {reading.unread[0]}" if reading.unread else ""
        raise PrecompileError(
            f"tracer='dynamo' could not read fn's own code (Dynamo ran it unread{why}); "
            "capture with tracer='make_fx' (the default)."
        )
    translator = _Translator(fn_code, anchors, made, _Home.of(fn))
    for frame in reading.frames:
        for guard in frame.guards:
            translator.add(frame, guard)
    for brk in reading.breaks:  # each carried (refuse_breaks refused the others)
        translator.counts[("GRAPH_BREAK", break_line(brk), CHECKED, str(carried(brk)))] += 1
    return Translated(tuple(translator.reads), translator.notes())


@dataclass(frozen=True)
class _Home:
    """Where a call finds again what ``fn`` holds: ``module`` is the user's module of ``fn``'s
    code, ``function`` the global there that holds ``fn``'s function (whose closure values a
    call reads through it), ``globals`` the global holding each other object, by id (the
    object a method ``fn`` belongs to, a partial's bound argument)."""

    module: str
    function: str | None
    globals: dict[int, str]

    @staticmethod
    def of(fn: Callable[..., Any]) -> _Home | None:
        target, _ = _as_function(fn, ())
        function = getattr(target, "__func__", target)
        name = getattr(function, "__module__", None)
        module = sys.modules.get(name) if isinstance(name, str) else None
        if module is None or not users_module(name):
            return None
        # The first global of a name holds an object (an alias defined later reads the same).
        held = {id(v): k for k, v in reversed(vars(module).items()) if not k.startswith("__")}
        return _Home(module.__name__, held.get(id(function)), held)


class _Translator:
    def __init__(
        self,
        fn_code: types.CodeType,
        anchors: Anchors,
        made: Sequence[ReadValue],
        home: _Home | None,
    ) -> None:
        self.fn_code = fn_code
        self.home = home
        self.anchors = anchors
        self.keys = {(r.submodule, r.module, tuple(r.path)) for r in made}
        self.reads: list[ReadValue] = []
        self.counts: Counter[tuple[str, str, str, str]] = Counter()
        # Guards on an object's class or namespace, held by the values read off it (if any).
        self.objects: list[tuple[tuple[Any, Any, tuple[str, ...]], str, str]] = []

    def notes(self) -> tuple[GuardNote, ...]:
        for key, kind, text in self.objects:
            held = sorted(".".join(k[2]) for k in self.keys if k[:2] == key[:2] and below(k, key))
            outcome, by = (
                (CHECKED, f"read values off it ({', '.join(held[:3])})")
                if held
                else (DROPPED, f"{'.'.join(key[2])} is an object no check compares")
            )
            self.counts[(kind, text, outcome, by)] += 1
        self.objects.clear()
        return tuple(GuardNote(*key, count=n) for key, n in self.counts.items())

    def add(self, frame: dynamo.FrameRead, guard: dynamo.RawGuard) -> None:
        outcome, by = self._outcome(frame, guard)
        if outcome == _LATER:
            return
        text = guard.text or "(torch state)"
        if outcome == CHECKED and by.startswith(_PER_MEMBER):
            text, by = _one_per_kind(text), _one_per_kind(by)
        elif outcome == CHECKED and by.startswith("read value") and "._modules[" in text:
            text = _one_per_kind(text)  # one note per attribute and value, across submodules
        self.counts[(guard.kind, text, outcome, by)] += 1

    def _outcome(self, frame: dynamo.FrameRead, guard: dynamo.RawGuard) -> tuple[str, str]:
        path = guard.path
        if path is None:
            if guard.kind == "WEAKREF_ALIVE":
                return FIXED, "Dynamo's own reference to an object it read"
            return DROPPED, f"no check of the artifact reads {guard.text}"
        if path.root == "state":
            return _STATE_CHECKS.get(guard.kind, (DROPPED, "torch state no check reads"))
        chain = walk(frame, path)
        anchored = self._anchored(chain, path, guard)
        if anchored is not None:
            return anchored
        if path.root == "global":
            return self._global(frame, path, chain, guard)
        return self._local(frame, path, chain[-1], guard)

    def _anchored(
        self, chain: list[Any], path: dynamo.GuardPath, guard: dynamo.RawGuard
    ) -> tuple[str, str] | None:
        """The deepest object on the path that the artifact checks already, if any."""
        for depth in range(len(chain) - 1, -1, -1):
            obj = chain[depth]
            rest = path.steps[depth:]
            if id(obj) in self.anchors.submodules:
                return self._module_read(self.anchors.submodules[id(obj)], rest, chain, guard)
            if isinstance(obj, torch.Tensor) and id(obj) in self.anchors.tensors:
                return CHECKED, f"tensor checks of {self.anchors.tensors[id(obj)]}"
            if id(obj) in self.anchors.optimizers:
                name = self.anchors.optimizers[id(obj)]
                return CHECKED, f"optimizer checks of {name} (class, param groups, options)"
        return None

    def _module_read(
        self, index: int, rest: tuple[dynamo.Step, ...], chain: list[Any], guard: dynamo.RawGuard
    ) -> tuple[str, str]:
        if not rest:
            return CHECKED, "module structure (class, forward, attributes, members)"
        first = rest[0].key if rest[0].kind == "attr" else None
        if first in _HOOK_DICTS or (first or "").startswith("_global_"):
            return CHECKED, "hook checks"
        if first in _STRUCTURE:
            return CHECKED, "module structure (class, forward, attributes, members)"
        names = attribute_names(rest)
        if names is None:
            return DROPPED, f"no check of the artifact reads {guard.text}"
        value = chain[-1]
        if isinstance(value, torch.nn.Module):
            return CHECKED, "module structure (class, forward, attributes, members)"
        return self._value(index, None, names, value, guard)

    def _global(
        self,
        frame: dynamo.FrameRead,
        path: dynamo.GuardPath,
        chain: list[Any],
        guard: dynamo.RawGuard,
    ) -> tuple[str, str]:
        if path.name.startswith("__builtins_dict"):  # Dynamo's handle on Python's builtins
            return FIXED, "Python's own builtins"
        module = frame.globals.get("__name__")
        if path.name.startswith("__import_"):  # Dynamo's handle on a module it imported
            root = sys.modules.get(path.name.removeprefix("__import_").replace("_dot_", "."))
            chain = [root, *walk_from(root, path.steps)]
        chain, path = cells_named(chain, path)
        value = chain[-1]
        steps: tuple[dynamo.Step, ...] = path.steps
        names: tuple[str, ...] = (path.name,)
        # The last module on the path holds what is read: the read goes through it.
        held = chain  # the objects from the first name read off the module to the value
        for i, obj in enumerate(chain):
            if isinstance(obj, types.ModuleType) and all(s.kind == "attr" for s in steps[:i]):
                module, names, steps, held = obj.__name__, (), path.steps[i:], chain[i + 1 :]
        if not isinstance(module, str):
            return DROPPED, f"no check of the artifact reads {guard.text}"
        if module == "torch" or module.startswith("torch."):
            return FIXED, "torch's own code, fixed by the torch build the artifact runs on"
        if module.startswith("_torch_precompile"):  # a loaded artifact's process-wide count
            return FIXED, "torch-precompile's own state (a loaded artifact's)"
        if not users_module(module):
            return self._library(module, names, steps, held, guard)
        if steps[:2] == (dynamo.Step("type"), dynamo.Step("typedict")):
            # A class attribute read through an instance: the artifact reads it off the class,
            # where that class is a global of the same module under its own name.
            cls: type = chain[1]
            holder = sys.modules.get(module)
            if len(names) != 1 or getattr(holder, cls.__name__, None) is not cls:
                return DROPPED, f"{guard.text}: a class attribute of a class no check can find"
            names = (cls.__name__,)
            steps = (dynamo.Step("attr", steps[2].key), *steps[3:]) if len(steps) > 2 else ()
        more = attribute_names(steps, through_classes=False, cells=True)
        if more is None or not (*names, *more):
            return DROPPED, f"no check of the artifact reads {guard.text}"
        return self._value(None, module, (*names, *more), value, guard)

    def _library(
        self,
        module: str,
        names: tuple[str, ...],
        steps: tuple[dynamo.Step, ...],
        held: list[Any],
        guard: dynamo.RawGuard,
    ) -> tuple[str, str]:
        """A read of the standard library's or an installed package's module state: ``names``
        then ``steps`` off the module, reaching the objects ``held``."""
        if module == "os" and not names and steps[:1] == (dynamo.Step("attr", "environ"),):
            return CHECKED, "environment variable checks (each variable the user's code reads)"
        value = held[-1] if held else sys.modules.get(module)  # the module itself
        if is_code(value) or any(isinstance(obj, type) for obj in held[:-1]):
            package = module.split(".")[0]
            return FIXED, f"code of {package}, as installed (not the user's to change)"
        more = attribute_names(steps, through_classes=False, cells=True)
        if more is None or not (*names, *more):
            return DROPPED, f"state of module {module} that no check reads ({guard.text})"
        return self._value(None, module, (*names, *more), value, guard)

    def _local(
        self, frame: dynamo.FrameRead, path: dynamo.GuardPath, value: Any, guard: dynamo.RawGuard
    ) -> tuple[str, str]:
        code = frame.code
        own = code is self.fn_code
        if path.name in code.co_freevars and (own or resumes(code, self.fn_code)):
            if self.home is not None and self.home.function is not None:
                held = (self.home.function, "__closure__", path.name)
                return self._through(held, path, value, guard)
            shown = shown_briefly(value)
            return DROPPED, (
                f"a value fn closes over ({path.name}={shown}): no call can reach it; pass it "
                "as an argument, or hold fn in a global of its module (a call then reads it "
                "there)"
            )
        if own and path.name in self.anchors.arguments:
            return CHECKED, f"input checks of argument {path.name} (its value or layout)"
        if own:  # the object a bound method fn belongs to, or a callable object itself
            root = frame.arguments.get(path.name, MISSING)
            name = self.home.globals.get(id(root)) if self.home and is_object(root) else None
            if name is not None:
                return self._through((name,), path, value, guard)
            return DROPPED, (
                f"{path.name!r} is the object fn belongs to, held by fn, not passed to it: no "
                "call can reach it; pass what changes as an argument, or hold the object in a "
                "global of its module (a call then reads it there)"
            )
        if resumes(code, self.fn_code):
            return FIXED, "a value fn computed before a graph break, from what it read"
        if not users_file(code.co_filename):
            return FIXED, "an argument torch's own code passed itself"
        return DROPPED, (
            f"argument {path.name!r} of {code.co_name} "
            f"({shown_path(code.co_filename)}:{code.co_firstlineno}), which Dynamo read apart "
            "from fn"
        )

    def _through(
        self, held: tuple[str, ...], path: dynamo.GuardPath, value: Any, guard: dynamo.RawGuard
    ) -> tuple[str, str]:
        """A local of fn's own frame read through the global that ``held`` names (fn's
        function then its closure variable, or the object fn belongs to)."""
        more = attribute_names(path.steps, through_classes=False, cells=True)
        if more is None or self.home is None:
            return DROPPED, f"no check of the artifact reads {guard.text}"
        return self._value(None, self.home.module, (*held, *more), value, guard)

    def _value(
        self,
        submodule: int | None,
        module: str | None,
        names: tuple[str, ...],
        value: Any,
        guard: dynamo.RawGuard,
    ) -> tuple[str, str]:
        key = (submodule, module, names)
        shown = ".".join(names)
        if any(covers(k, key) for k in self.keys):
            return CHECKED, f"read value {shown} == {shown_briefly(value)}"
        encoded = None if value is MISSING else encode(value, Use.READ)
        if guard.at_read is not None and encoded != guard.at_read:
            return DROPPED, f"{shown}: fn changes it as it runs, so no call could pass its check"
        if encoded is None and guard.kind in _OBJECT_KINDS:
            encoded = encode_object(value)  # its class and the values it holds
        if encoded is None:
            if guard.kind in _OBJECT_KINDS:
                self.objects.append((key, guard.kind, guard.text))
                return _LATER, ""
            return DROPPED, f"{shown} holds {type(value).__name__}, which no check compares"
        where, script = "read by Dynamo", None
        if module == "__main__":  # the script a later process must run for these globals
            script = script_name(module, vars(sys.modules["__main__"]))
        if guard.line:
            file, _, line = guard.line.rpartition(":")
            where = f"{shown_path(file)}:{line}"
        self.reads.append(ReadValue(submodule, module, names, encoded, where, script))
        self.keys.add(key)
        return CHECKED, f"read value {shown} == {shown_briefly(value)}"


# Checks a model holds once per member (each submodule's hooks, each tensor): their guards are
# listed once per kind and place, with a count, not once per submodule or tensor.
_PER_MEMBER = ("module structure", "hook checks", "tensor checks of model", "optimizer checks")
_MEMBER_NAMES = (
    (re.compile(r"(\._modules\['[^']*'\])+"), "._modules[...]"),  # a submodule's path
    (re.compile(r"(\._parameters|\._buffers|\['params'\])\[[^\]]*\]"), r"\1[...]"),
    (re.compile(r"'[\w.]+'$"), "'...'"),  # a tensor's name closing a check's description
    (re.compile(r"\[\d+\]"), "[...]"),  # an index: a param group's, an optimizer state's
)


def _one_per_kind(text: str) -> str:
    """``text`` with the names of submodules, tensors and parameter indices left out."""
    for pattern, kept in _MEMBER_NAMES:
        text = pattern.sub(kept, text)
    return text


_NO_CODE = (lambda: None).__code__
_LATER = "later"  # an object's guard, settled once every value read off it is known


# Guards on an object as a whole: its class, its namespace's keys, its identity.
_OBJECT_KINDS = frozenset(
    {"TYPE_MATCH", "ID_MATCH", "NOT_PRESENT_IN_GENERIC_DICT", "HASATTR", "DICT_KEYS_MATCH"}
)
