"""Every fact capture records is read where a call is checked: a spec field that no shipped
driver module reads would be a fact recorded and then forgotten."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any

import torch_precompile.shipped.driver as driver_package
from torch_precompile.artifact import render
from torch_precompile.spec import ArtifactSpec

# Fields read outside the per-call driver, with where and why.
READ_ELSEWHERE = {
    "ArtifactSpec.schema_version": "load refuses an unreadable schema before executing",
    "ArtifactSpec.torch": "load refuses another torch build before executing",
    "TorchBuild.version": "load compares it with the running torch",
    "TorchBuild.git": "load compares it with the running torch",
    "ArtifactSpec.kernels": "load checks each cached kernel object against its digest",
    "KernelObject.key": "load finds each kernel object by it",
    "KernelObject.sha256": "load checks each kernel object against it",
    "ArtifactSpec.backend": "load pairs the cache's backend with it",
    "ArtifactSpec.variants": "the variants part reads each variant's literal by key",
    "ArtifactSpec.output_aliases": "the lowering builds results that view inputs from it",
    "OutputAlias.output": "the lowering builds results that view inputs from it",
    "OutputAlias.source": "the lowering builds results that view inputs from it",
    "OutputAlias.size": "the lowering builds results that view inputs from it",
    "OutputAlias.stride": "the lowering builds results that view inputs from it",
    "OutputAlias.offset": "the lowering builds results that view inputs from it",
    "ParamGroup.call_time": "names the options the optimizer part reads at every call (lr)",
    "FullyShardedGroup.reshard_after_forward": "memory only: either way the step computes "
    "the same values",
    "Autograd.saved": "a description for inspect; the backward graph takes what the forward "
    "graph returns",
    "ArtifactSpec.wrappers": "a description for inspect; each graph's source is its wrapper",
    # The dynamo tracer's guard report: each guard it kept is a check recorded as another
    # fact (a read value, a hook set, ...); the report says which, for inspect.
    "ArtifactSpec.guards": "the guard report, for inspect and require_all_guards",
    "GuardNote.kind": "the guard report, for inspect",
    "GuardNote.reads": "the guard report, for inspect",
    "GuardNote.outcome": "the guard report, for inspect and require_all_guards",
    "GuardNote.by": "the guard report, for inspect",
    "GuardNote.count": "the guard report, for inspect",
}
# Recorded facts a call is not yet checked against, and what that leaves to the caller.
KNOWN_UNCHECKED: dict[str, str] = {}


# Which driver reads count. A field counts as read where the driver reads it off a value that
# holds a record of its class: the named tuple ``read_spec`` makes (``spec.seed``), a record
# taken from one of the spec's lists (``for leaf in spec.inputs: leaf.shape``), or the
# literal by key (``literal["variants"]``, ``record.get("inputs")``). Which values hold
# records is followed through the driver: names, attributes of its classes' instances,
# containers (lists, tuples by position, dicts), parameters (from every call of a function,
# method or class of the driver, and from annotations naming a driver class) and returns.
#
# Tags for what a value may hold: ("rec", R) a record of class R, ("lit", R) one as the
# literal's mapping, ("inst", C) an instance of the driver's class C, ("bound", "C.m") that
# method of one, ("seq", tags) a sequence of such values, ("tuple", (tags, ...)) a tuple by
# position, ("map", tags) a dict whose values hold them.
Tags = frozenset[Any]
NONE: Tags = frozenset()
FIELDS = {
    cls.__name__: {field.name for field in dataclasses.fields(cls)}
    for cls in (ArtifactSpec, *ArtifactSpec.RECORDS.values())
}
# What each of ArtifactSpec's record fields holds: ("one" or "many", the record's class).
HOLDS = {
    name: ("one" if name in ArtifactSpec.SINGLE else "many", cls.__name__)
    for name, cls in ArtifactSpec.RECORDS.items()
}
# Where records come in, as an artifact's last lines hand them over: Driver takes
# ARTIFACT_SPEC (or variant_spec's part of it), Variants the drivers, PlainForward the literals
# of the autograd records; read_spec builds the named tuples by table, naming no field.
ENTRY_PARAMETERS: dict[tuple[Any, str], Tags] = {
    ("Driver.__init__", "literal"): frozenset({("lit", "ArtifactSpec")}),
    ("Variants.__init__", "drivers"): frozenset({("seq", frozenset({("inst", "Driver")}))}),
    ("PlainForward.__init__", "autograd_records"): frozenset(
        {("seq", frozenset({("lit", "Autograd")}))}
    ),
}
ENTRY_RETURNS: dict[str, Tags] = {
    "read_spec": frozenset({("rec", "ArtifactSpec")}),
    "variant_spec": frozenset({("lit", "ArtifactSpec")}),
}
# The classes an artifact gives Driver by keyword (its optional parts); Driver calls each.
DRIVER_PARTS: dict[str, set[str]] = {}
for _part in render._PART_ORDER:
    if _part.keyword and _part.factory:
        DRIVER_PARTS.setdefault(_part.keyword, set()).add(_part.factory)
AS_SEQUENCE = {"tuple", "list", "sorted", "reversed", "iter", "set", "frozenset"}
MUTATORS = {"append", "add", "extend", "insert"}
DEEPEST = 12  # tags nest no deeper (the analysis then ends)


def _seq(tags: Tags) -> Tags:
    return frozenset({("seq", tags)}) if tags else NONE


def _depth(tag: Any) -> int:
    if isinstance(tag, tuple | frozenset):
        return 1 + max((_depth(t) for t in tag), default=0)
    return 0


class DriverReads:
    """The (record class, field) pairs the shipped driver reads off a record of that class."""

    def __init__(self) -> None:
        self.functions: dict[str, tuple[ast.FunctionDef, str | None]] = {}
        self.bases: dict[str, list[str]] = {}
        for info in pkgutil.iter_modules(driver_package.__path__):
            module = importlib.import_module(f"{driver_package.__name__}.{info.name}")
            for node in ast.parse(inspect.getsource(module)).body:
                if isinstance(node, ast.FunctionDef):
                    self.functions[node.name] = (node, None)
                elif isinstance(node, ast.ClassDef):
                    self.bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef):
                            self.functions[f"{node.name}.{item.name}"] = (item, node.name)
        self.names: dict[tuple[Any, str], Tags] = dict(ENTRY_PARAMETERS)
        self.attributes: dict[tuple[str, str], Tags] = {}
        self.returns: dict[str, Tags] = dict(ENTRY_RETURNS)
        self.reads: set[tuple[str, str]] = set()
        for _ in range(50):  # to a fixed point: a pass only adds what values may hold
            self.changed = False
            for name, (node, cls) in self.functions.items():
                _Walk(self, name, cls).function(node)
            if not self.changed:
                break
        else:
            raise AssertionError("following records through the driver did not settle")

    def add(self, table: dict[Any, Tags], key: Any, tags: Tags) -> None:
        tags = frozenset(t for t in tags if _depth(t) <= DEEPEST)
        if not tags <= table.get(key, NONE):
            table[key] = table.get(key, NONE) | tags
            self.changed = True

    def lineage(self, cls: str) -> list[str]:
        found: list[str] = []
        while cls in self.bases and cls not in found:
            found.append(cls)
            cls = next(iter(self.bases[cls]), "")
        return found

    def method(self, cls: str, name: str) -> str | None:
        qualified = (f"{c}.{name}" for c in self.lineage(cls))
        return next((q for q in qualified if q in self.functions), None)


class _Walk:
    """One pass over one function: what its expressions hold, and the reads among them."""

    def __init__(self, program: DriverReads, name: str, cls: str | None) -> None:
        self.p, self.name, self.cls = program, name, cls
        self.scopes: list[Any] = [name]  # the function's, then a comprehension's or lambda's

    def function(self, node: ast.FunctionDef) -> None:
        params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        static = any(getattr(d, "id", None) == "staticmethod" for d in node.decorator_list)
        for index, param in enumerate(params):
            tags = set()
            if index == 0 and self.cls and not static and self.scopes == [self.name]:
                tags.add(("inst", self.cls))
            annotation = param.annotation
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                annotation = ast.parse(annotation.value, mode="eval").body
            if isinstance(annotation, ast.Name) and annotation.id in self.p.bases:
                tags.add(("inst", annotation.id))
            self.p.add(self.p.names, (self.scopes[-1], param.arg), frozenset(tags))
        for statement in node.body:
            self.statement(statement)

    def lookup(self, name: str) -> Tags:
        for scope in reversed(self.scopes):
            if (scope, name) in self.p.names:
                return self.p.names[(scope, name)]
        return NONE

    def bind(self, target: ast.expr, tags: Tags) -> None:
        if isinstance(target, ast.Name):
            self.p.add(self.p.names, (self.scopes[-1], target.id), tags)
        elif isinstance(target, ast.Attribute):
            for tag in self.type(target.value):
                if tag[0] == "inst":
                    self.p.add(self.p.attributes, (tag[1], target.attr), tags)
        elif isinstance(target, ast.Subscript):
            self.type(target.slice)
            self.fill(target.value, tags)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, _seq(tags))
        elif isinstance(target, ast.Tuple | ast.List):
            count = len(target.elts)
            for index, element in enumerate(target.elts):
                parts = [t[1][index] for t in tags if t[0] == "tuple" and len(t[1]) == count]
                if not isinstance(element, ast.Starred):
                    parts.append(self.elements(frozenset(t for t in tags if t[0] == "seq")))
                self.bind(element, frozenset().union(*parts))

    def fill(self, container: ast.expr, tags: Tags) -> None:
        """``container`` (a list or dict) now also holds values of ``tags``."""
        if tags:
            self.bind(container, _seq(tags) | {("map", tags)})

    @staticmethod
    def elements(tags: Tags) -> Tags:
        """What iterating over a value of ``tags`` gives."""
        found: set[Any] = set()
        for tag in tags:
            if tag[0] == "seq":
                found |= tag[1]
            elif tag[0] == "tuple":
                found |= frozenset().union(*tag[1])
        return frozenset(found)

    def field(self, tag: Any, name: Any) -> Tags:
        """Field ``name`` of a record (or its literal): a read, and what the field holds."""
        if tag[0] not in ("rec", "lit") or name not in FIELDS[tag[1]]:
            return NONE
        self.p.reads.add((tag[1], name))
        if tag[1] != "ArtifactSpec" or name not in HOLDS:
            return NONE
        how, record = HOLDS[name]
        one = frozenset({(tag[0], record)})
        return one if how == "one" else _seq(one)

    def type(self, node: ast.expr | None) -> Tags:
        """What ``node`` may hold (and, walking it, the reads inside it)."""
        if node is None:
            return NONE
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            return self.attribute(node)
        if isinstance(node, ast.Subscript):
            return self.subscript(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            parts = [
                self.elements(self.type(e.value)) if isinstance(e, ast.Starred) else self.type(e)
                for e in node.elts
            ]
            whole = _seq(frozenset().union(*parts))
            if isinstance(node, ast.Tuple) and not any(
                isinstance(e, ast.Starred) for e in node.elts
            ):
                return whole | {("tuple", tuple(parts))}
            return whole
        if isinstance(node, ast.Dict):
            for key in node.keys:
                self.type(key)
            values = frozenset().union(*(self.type(v) for v in node.values))
            return frozenset({("map", values)}) if values else NONE
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            return self.comprehension(node)
        if isinstance(node, ast.IfExp):
            self.type(node.test)
            return self.type(node.body) | self.type(node.orelse)
        if isinstance(node, ast.BoolOp):
            return frozenset().union(*(self.type(v) for v in node.values))
        if isinstance(node, ast.NamedExpr):
            tags = self.type(node.value)
            self.bind(node.target, tags)
            return tags
        if isinstance(node, ast.Lambda):
            self.scopes.append(id(node))
            self.type(node.body)
            self.scopes.pop()
            return NONE
        for child in ast.iter_child_nodes(node):  # operators, comparisons, f-strings
            if isinstance(child, ast.expr):
                self.type(child)
        return NONE

    def attribute(self, node: ast.Attribute) -> Tags:
        found: set[Any] = set()
        for tag in self.type(node.value):
            if tag[0] == "rec":
                found |= self.field(tag, node.attr)
            elif tag[0] == "inst":
                for cls in self.p.lineage(tag[1]):
                    found |= self.p.attributes.get((cls, node.attr), NONE)
                method = self.p.method(tag[1], node.attr)
                if method is not None:
                    found.add(("bound", method))
        return frozenset(found)

    def subscript(self, node: ast.Subscript) -> Tags:
        self.type(node.slice)
        key = node.slice.value if isinstance(node.slice, ast.Constant) else None
        sliced = isinstance(node.slice, ast.Slice)
        found: set[Any] = set()
        for tag in self.type(node.value):
            if tag[0] == "lit" and isinstance(key, str):
                found |= self.field(tag, key)
            elif tag[0] == "seq":
                found |= {tag} if sliced else tag[1]
            elif tag[0] == "map":
                found |= tag[1]
            elif tag[0] == "tuple" and isinstance(key, int) and -len(tag[1]) <= key < len(tag[1]):
                found |= tag[1][key]
            elif tag[0] == "tuple":
                whole = frozenset().union(*tag[1])
                found |= _seq(whole) if sliced else whole
        return frozenset(found)

    def comprehension(
        self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp
    ) -> Tags:
        self.scopes.append(id(node))
        for generator in node.generators:
            self.bind(generator.target, self.elements(self.type(generator.iter)))
            for condition in generator.ifs:
                self.type(condition)
        if isinstance(node, ast.DictComp):
            self.type(node.key)
            values = self.type(node.value)
            made = frozenset({("map", values)}) if values else NONE
        else:
            made = _seq(self.type(node.elt))
        self.scopes.pop()
        return made

    def call(self, node: ast.Call) -> Tags:
        args = [self.type(a) for a in node.args]
        keywords = {k.arg: self.type(k.value) for k in node.keywords}
        func = node.func
        if isinstance(func, ast.Name):
            return self.call_name(func.id, args, keywords)
        if not isinstance(func, ast.Attribute):
            self.type(func)
            return NONE
        found: set[Any] = set()
        for tag in self.type(func.value):
            if tag[0] == "inst":
                methods = [self.p.method(tag[1], func.attr)] + [
                    held[1]
                    for cls in self.p.lineage(tag[1])
                    for held in self.p.attributes.get((cls, func.attr), NONE)
                    if held[0] == "bound"
                ]
                for method in filter(None, methods):
                    self.give(method, args, keywords, 1)
                    found |= self.p.returns.get(method, NONE)
            elif tag[0] == "lit" and func.attr == "get" and node.args:
                key = node.args[0]
                found |= self.field(tag, key.value) if isinstance(key, ast.Constant) else NONE
            elif tag[0] == "map" and func.attr in ("get", "pop", "setdefault"):
                found |= tag[1]
            elif tag[0] == "map" and func.attr == "values":
                found |= _seq(tag[1])
            elif tag[0] == "map" and func.attr == "items":
                found |= _seq(frozenset({("tuple", (NONE, tag[1]))}))
        if func.attr in MUTATORS and args:
            self.fill(func.value, self.elements(args[-1]) if func.attr == "extend" else args[-1])
        return frozenset(found)

    def call_name(self, name: str, args: list[Tags], keywords: dict[Any, Tags]) -> Tags:
        if self.name == "Driver.__init__" and name in DRIVER_PARTS:
            made: set[Any] = set()  # a part the artifact gave: Driver constructs it
            for factory in DRIVER_PARTS[name] & self.p.bases.keys():
                made |= self.call_name(factory, args, keywords)
            return frozenset(made)
        if name in self.p.functions:
            self.give(name, args, keywords, 0)
            return self.p.returns.get(name, NONE)
        if name in self.p.bases:
            self.give(self.p.method(name, "__init__"), args, keywords, 1)
            return frozenset({("inst", name)})
        if name in AS_SEQUENCE and args:
            return _seq(self.elements(args[0]))
        if name == "next" and args:
            return self.elements(args[0]) | (args[1] if len(args) > 1 else NONE)
        if name == "enumerate" and args:
            return _seq(frozenset({("tuple", (NONE, self.elements(args[0])))}))
        if name == "zip":
            return _seq(frozenset({("tuple", tuple(self.elements(a) for a in args))}))
        if name == "super" and self.cls:
            return frozenset({("inst", base) for base in self.p.bases[self.cls]})
        return NONE

    def give(
        self, function: str | None, args: list[Tags], keywords: dict[Any, Tags], bound: int
    ) -> None:
        """A call of ``function`` (whose first ``bound`` parameters are bound already)."""
        if function is None:
            return
        signature = self.p.functions[function][0].args
        positional = [a.arg for a in (*signature.posonlyargs, *signature.args)][bound:]
        for index, tags in enumerate(args):
            if index < len(positional):
                self.p.add(self.p.names, (function, positional[index]), tags)
            elif signature.vararg is not None:
                self.p.add(self.p.names, (function, signature.vararg.arg), _seq(tags))
        named = {a.arg for a in (*signature.args, *signature.kwonlyargs)}
        for key, tags in keywords.items():
            if key in named:
                self.p.add(self.p.names, (function, key), tags)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.ClassDef):
            return
        if isinstance(node, ast.FunctionDef):  # a nested function: its own names
            self.scopes.append(id(node))
            self.function(node)
            self.scopes.pop()
            return
        if isinstance(node, ast.Assign):
            tags = self.type(node.value)
            for target in node.targets:
                self.bind(target, tags)
            return
        if isinstance(node, ast.AnnAssign | ast.AugAssign):
            if node.value is not None:
                self.bind(node.target, self.type(node.value))
            return
        if isinstance(node, ast.Return):
            self.p.add(self.p.returns, self.name, self.type(node.value))
            return
        if isinstance(node, ast.For):
            self.bind(node.target, self.elements(self.type(node.iter)))
        for name, value in ast.iter_fields(node):
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, ast.stmt):
                    self.statement(item)
                elif isinstance(item, ast.expr) and name != "target":
                    self.type(item)
                elif isinstance(item, ast.withitem):
                    tags = self.type(item.context_expr)
                    if item.optional_vars is not None:
                        self.bind(item.optional_vars, tags)
                elif isinstance(item, ast.excepthandler):
                    for statement in item.body:
                        self.statement(statement)


def _unread(reads: set[tuple[str, str]]) -> list[str]:
    return [
        f"{cls.__name__}.{field.name}"
        for cls in (ArtifactSpec, *ArtifactSpec.RECORDS.values())
        for field in dataclasses.fields(cls)
        if (cls.__name__, field.name) not in reads
        and f"{cls.__name__}.{field.name}" not in READ_ELSEWHERE.keys() | KNOWN_UNCHECKED
    ]


def test_every_recorded_fact_is_read_by_the_driver() -> None:
    """Each spec field is read by the shipped driver off a value that holds a record of its
    class (see ``DriverReads``), or is listed above. An attribute that only shares a field's
    name (``group.size()``, ``tensor.device``) is no read of it.

    What this cannot see, and so leaves to review: a read is not a check (a field read only to
    be shown in a message counts); names are followed per function, not per line (a name that
    holds a record in one place and another value elsewhere in the same function has its
    attributes counted as reads everywhere); and a read it cannot follow (by position,
    ``getattr`` with a computed name, unpacking a record, a value passed through a function
    outside the driver) is not counted, so such a field must be listed in READ_ELSEWHERE."""
    reads = DriverReads().reads
    unread = _unread(reads)
    assert not unread, (
        f"capture records {unread}, which no per-call check reads: check it in the driver "
        "(and test that a call breaking it is refused), or stop recording it."
    )
    stale = [name for name in KNOWN_UNCHECKED if tuple(name.split(".")) in reads]
    assert not stale, f"the driver reads {stale} now: take them out of KNOWN_UNCHECKED."


def test_the_check_fails_for_a_fact_nobody_reads(monkeypatch) -> None:
    """The test above catches a new field the driver never reads, one that only shares its
    name with what the driver reads off something else (a tensor's ``device``), and a field of
    the spec whose name other objects in the driver have (``OutputAlias.size`` beside a
    process group's ``size()``)."""

    @dataclasses.dataclass(frozen=True)
    class Extra:
        forgotten_fact_xyz: int = 0
        device: str = "cpu"

    monkeypatch.setitem(ArtifactSpec.RECORDS, "extra", Extra)
    monkeypatch.delitem(READ_ELSEWHERE, "OutputAlias.size")
    try:
        test_every_recorded_fact_is_read_by_the_driver()
    except AssertionError as error:
        for name in ("Extra.forgotten_fact_xyz", "Extra.device", "OutputAlias.size"):
            assert name in str(error)
    else:
        raise AssertionError("an unread field went unnoticed")
