"""Torch internals that the inductor lowering uses, and every rewrite of Inductor's output.

Inductor's entry points (decompositions, ``compile_fx_inner``, its config and code cache) and
the shape of the wrapper module it generates change between torch releases; this module is
where those differences live. Each rewrite of generated code asserts that it matched exactly
where expected, so a torch change fails at build time, never silently at load time.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import FakeTensor, FakeTensorMode, make_fx
from torch_precompile.internals.vector_units import probe_vector_units

# Inductor settings the artifact depends on: stride asserts on (the layout contract), no
# benchmark harness in the source, and random ops run by ATen's own kernels on torch's
# generator (fallback_random), so that a call seeded as an eager one draws the same numbers
# (Inductor's own random kernels draw others). Which wrapper Inductor writes is
# compile_to_wrapper's argument.
INDUCTOR_OPTIONS: dict[str, Any] = {
    "size_asserts": True,
    "benchmark_harness": False,
    "freezing": False,
    "fallback_random": True,
}
# A build compiles each C++ header once. Precompiling the headers first (once per machine and
# set of flags, which Inductor does by default) cost 13 s more on a fresh machine and saved
# 3 s per build on one that had them: so off, unless the environment asks
# (TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=1 where one machine makes many builds).
if "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS" not in os.environ:
    INDUCTOR_OPTIONS["cpp_cache_precompile_headers"] = False
# The C++ source and the building of Inductor's C++ wrapper, in the module it generates.
_CPP_WRAPPER_SOURCE = "cpp_wrapper_src"
_CPP_WRAPPER_BUILD = "CppWrapperCodeCache.load_pybinding"
# One layout assert of an input in the C++ wrapper, a line of its own.
_CPP_INPUT_ASSERT = re.compile(
    r'^[ \t]*assert_size_stride\((\w+), \{[^}]*\}, \{[^}]*\}, "input"\);\n', re.MULTILINE
)
_INDUCTOR_IMPORT = re.compile(
    r"^from (torch\._inductor[\w.]*) import (\w+)(?: as (\w+))?$", re.MULTILINE
)


def retrace_for_inductor(
    fn: Callable[..., Any], inputs: list[torch.Tensor], fake_mode: FakeTensorMode | None
) -> torch.fx.GraphModule:
    """Trace ``fn`` on fake tensors with Inductor's decompositions (inside ``fake_mode``
    when given, so a dynamic capture's unbacked symbols carry over)."""
    # The max-pooling decompositions ask torch._inductor.lowering whether to fall back, an
    # attribute that exists only once that module was imported (compile_fx imports it later).
    import torch._inductor.lowering  # noqa: F401

    decompositions = _decomposition_table()
    if fake_mode is None:
        return make_fx(fn, decomposition_table=decompositions, tracing_mode="fake")(*inputs)
    with fake_mode:
        fakes = [t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t) for t in inputs]
        return make_fx(fn, decomposition_table=decompositions)(*fakes)


def decomposition_table() -> dict[Any, Any]:
    """Inductor's decompositions, as the lowering retraces with them."""
    return _decomposition_table()


def _decomposition_table() -> dict[Any, Any]:
    """Inductor's decompositions, with ``cat`` giving the layout eager ``cat`` gives."""
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    with inductor_config.patch(INDUCTOR_OPTIONS):
        table = dict(select_decomp_table())
    inductor_cat = table.get(torch.ops.aten.cat.default)
    if inductor_cat is not None:
        table[torch.ops.aten.cat.default] = functools.partial(_eager_layout_cat, inductor_cat)
    return table


def _eager_layout_cat(inductor_cat: Any, tensors: list[torch.Tensor], dim: int = 0) -> Any:
    """Inductor's ``cat`` decomposition, its result laid out as eager lays it out.

    Inductor drops empty inputs (``torch.cat([torch.tensor([]), t])``, as Hugging Face caches
    start) and returns a clone of what is left, keeping that input's strides; eager picks the
    output memory format from all inputs, empty ones included (contiguous for a transposed
    ``t``). The captured graph's later views were recorded on eager's layout and cannot be
    applied to another one, so the clone is made in eager's format.
    """
    from torch._prims_common import (
        is_contiguous_for_memory_format_or_false,
        suggest_memory_format,
    )

    result = inductor_cat(tensors, dim)
    if result is NotImplemented or not isinstance(result, torch.Tensor):
        return result
    formats = {suggest_memory_format(t) for t in tensors}
    memory_format = formats.pop() if len(formats) == 1 else torch.contiguous_format
    if is_contiguous_for_memory_format_or_false(result, memory_format=memory_format):
        return result
    return result.clone(memory_format=memory_format)


def compile_to_wrapper(
    graph: torch.fx.GraphModule,
    fake_mode: FakeTensorMode | None,
    options: dict[str, Any],
    cpp_wrapper: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Compile ``graph`` with Inductor, its wrapper in Python or (``cpp_wrapper``) C++; return
    the generated wrapper module's source and the tensor constants it names (``constant0 =
    None`` in the source; Inductor sets them on the loaded module)."""
    import torch._inductor.config as inductor_config
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    fake_inputs = [p.meta["val"] for p in graph.graph.find_nodes(op="placeholder")]
    _every_output_keeps_its_layout(graph)
    probe_vector_units()
    if fake_mode is None:
        fake_mode = next((v.fake_mode for v in fake_inputs if hasattr(v, "fake_mode")), None)
    # Without a tracing context Inductor bypasses its FX graph cache.
    with (
        tracing(TracingContext(fake_mode or FakeTensorMode())),
        inductor_config.patch({**INDUCTOR_OPTIONS, **options}),
        _cpp_wrapper_left_unbuilt(),
    ):
        compiled = compile_fx_inner(graph, fake_inputs, is_inference=True, cpp_wrapper=cpp_wrapper)
    source = getattr(compiled, "source_code", None)
    expected = _CPP_WRAPPER_BUILD if cpp_wrapper else "runner.call"
    if not source or expected not in source:
        kind = "C++" if cpp_wrapper else "Python"
        raise PrecompileError(
            f"Inductor produced no {kind} wrapper for this graph; use backend='eager'."
        )
    return source, dict(getattr(compiled, "constants", None) or {})


def _every_output_keeps_its_layout(graph: torch.fx.GraphModule) -> None:
    """Have Inductor return each output in the layout the trace recorded for it.

    ``compile_fx`` marks which outputs the user sees, and Inductor keeps the recorded strides
    of those alone; ``compile_fx_inner``, called directly, marks none, so a convolution's
    output could come back channels-last where eager's is contiguous. Every output of a graph
    here is seen: the caller's results, or the values a later piece's kernels read in the
    layout they were compiled for.
    """
    output = graph.graph.output_node()
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    output.meta["user_visible_output_idxs"] = [
        i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)
    ]


@contextlib.contextmanager
def _cpp_wrapper_left_unbuilt() -> Iterator[None]:
    """In this thread, Inductor loads the C++ wrapper module it generates without building
    its shared object. The package builds it once, later, from the source less the input
    asserts the driver makes redundant (``built_wrapper_object``): Inductor's own build, the
    longest step of a deep graph's lowering, would be thrown away. Other threads (a load that
    builds a wrapper) get the real builder."""
    import inspect
    import threading

    from torch._inductor.codecache import CppWrapperCodeCache

    own = "load_pybinding" in vars(CppWrapperCodeCache)
    real = inspect.getattr_static(CppWrapperCodeCache, "load_pybinding")
    builder = threading.get_ident()

    def load_pybinding(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == builder:
            return _unbuilt_entry
        return real.__get__(None, CppWrapperCodeCache)(*args, **kwargs)

    CppWrapperCodeCache.load_pybinding = staticmethod(load_pybinding)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own:
            CppWrapperCodeCache.load_pybinding = real  # type: ignore[method-assign]
        else:
            del CppWrapperCodeCache.load_pybinding


def _unbuilt_entry(*_: Any) -> Any:
    raise PrecompileError("internal: Inductor's C++ wrapper was called before it was built")


def data_dependent_condition(error: BaseException) -> str | None:
    """The condition of a data-dependent guard anywhere in ``error``'s chain, if any."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, GuardOnDataDependentSymNode) or "GuardOnDataDependentSymNode" in str(
            seen
        ):
            found = re.search(r"data-dependent expression (.+?) \(unhinted", str(seen))
            return found[1] if found else "a size condition"
        seen = seen.__cause__ or seen.__context__
    return None


def asserted_inputs(wrapper: str) -> list[str]:
    """The wrapper's inputs whose sizes and strides it asserts.

    torch 2.13 writes ``assert_size_stride(name, sizes, strides)`` per input; from 2.14 inputs
    checked at one spot share ``assert_size_stride_grouped((a, b), (sizes_a, sizes_b),
    (strides_a, strides_b), 'input')``.
    The C++ wrapper asserts each input on a line of its own.
    """
    if is_cpp_wrapper(wrapper):
        return _CPP_INPUT_ASSERT.findall(cpp_wrapper_source(wrapper))
    names: list[str] = []
    for node in ast.walk(ast.parse(wrapper)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        first = node.args[0]
        if node.func.id == "assert_size_stride" and isinstance(first, ast.Name):
            names.append(first.id)
        elif node.func.id == "assert_size_stride_grouped" and isinstance(first, ast.Tuple):
            names.extend(e.id for e in first.elts if isinstance(e, ast.Name))
    if not names and re.search(r"\bassert_size_stride(_grouped)?\(", wrapper):
        raise PrecompileError(
            "internal: Inductor's generated wrapper asserts layouts in a form this "
            f"torch-precompile does not read (torch {torch.__version__}); this torch release is "
            "not supported yet. Use backend='eager'."
        )
    return names


def is_cpp_wrapper(wrapper: str) -> bool:
    return f"\n{_CPP_WRAPPER_SOURCE} = (" in wrapper


def cpp_wrapper_source(wrapper: str) -> str:
    """The C++ source of a C++ wrapper module."""
    for node in ast.parse(wrapper).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == _CPP_WRAPPER_SOURCE
        ):
            return str(ast.literal_eval(node.value))
    raise PrecompileError(
        f"internal: Inductor's C++ wrapper module has no {_CPP_WRAPPER_SOURCE} (torch "
        f"{torch.__version__}); this torch release is not supported yet. Use wrapper='python'."
    )


def without_input_asserts(wrapper: str, names: set[str]) -> str:
    """The wrapper without its layout asserts of the inputs ``names`` (a grouped assert keeps
    the inputs not in ``names``). A C++ wrapper loses them before its shared object is built
    (each one costs a string stream per call there)."""
    if is_cpp_wrapper(wrapper):
        return _CPP_INPUT_ASSERT.sub(lambda m: "" if m[1] in names else m[0], wrapper)
    lines = wrapper.splitlines(keepends=True)
    statements = [n for n in ast.walk(ast.parse(wrapper)) if isinstance(n, ast.Expr)]
    for node in sorted(statements, key=lambda n: -n.lineno):  # bottom up: lines shift
        call = node.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.args):
            continue
        first = call.args[0]
        if call.func.id == "assert_size_stride" and isinstance(first, ast.Name):
            kept: list[int] | None = [] if first.id in names else None
        elif call.func.id == "assert_size_stride_grouped" and isinstance(first, ast.Tuple):
            kept = [
                i
                for i, e in enumerate(first.elts)
                if not (isinstance(e, ast.Name) and e.id in names)
            ]
            kept = None if len(kept) == len(first.elts) else kept
            if kept:
                call = _grouped_assert_of(call, kept)
        else:
            continue
        if kept is None:
            continue
        start, end = node.lineno - 1, node.end_lineno or node.lineno
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        lines[start:end] = [f"{indent}{ast.unparse(call)}\n"] if kept else []
    return "".join(lines)


def _grouped_assert_of(call: ast.Call, kept: list[int]) -> ast.Call:
    """A grouped assert (names, sizes and strides, one entry each per input) of the inputs at
    ``kept``; a single one becomes a plain ``assert_size_stride``."""
    parts = call.args[:3]
    if not all(
        isinstance(part, ast.Tuple) and len(part.elts) == len(cast(ast.Tuple, parts[0]).elts)
        for part in parts
    ):
        raise PrecompileError(
            "internal: Inductor's grouped layout assert is not in the form (names), (sizes), "
            f"(strides) (torch {torch.__version__}); this torch release is not supported yet. "
            "Use backend='eager'."
        )
    picked = [[cast(ast.Tuple, part).elts[i] for i in kept] for part in parts]
    rest = call.args[3:]
    if len(kept) == 1:
        return ast.Call(
            ast.Name("assert_size_stride", ast.Load()), [p[0] for p in picked] + rest, call.keywords
        )
    return ast.Call(call.func, [ast.Tuple(p, ast.Load()) for p in picked] + rest, call.keywords)


def _replace_once(source: str, old: str, new: str) -> str:
    count = source.count(old)
    if count != 1:
        raise PrecompileError(
            f"internal: Inductor's generated wrapper has {count} occurrences of {old.strip()!r} "
            f"where exactly one was expected (torch {torch.__version__}); this torch release "
            "is not supported by this torch-precompile yet. Use backend='eager'."
        )
    return source.replace(old, new)


def wrapper_with_stand_ins(wrapper: str, bits: int) -> str:
    """The wrapper with its Inductor imports replaced by the stand-ins of ``kernel_loader``
    (kernels generated for ``bits``-bit vectors) and ``wrapper_imports``, and its ``call``
    renamed ``inductor_call``."""

    def stand_in(match: re.Match[str]) -> str:
        module, name, alias = match.groups()
        if name == "AsyncCompile":
            return "# (AsyncCompile: replaced by KernelLoader)"
        if name == "extern_kernels":
            return "extern_kernels = ExternKernels()"
        return f"{alias or name} = LazyImport({module!r}, {name!r})"

    loader = f"KernelLoader(globals().get('PRECOMPILED_KERNELS', {{}}), vector_bits={bits})"
    if is_cpp_wrapper(wrapper):
        return _cpp_wrapper_with_stand_ins(wrapper, loader)
    source, count = _INDUCTOR_IMPORT.subn(stand_in, wrapper)
    if not count or "AsyncCompile: replaced" not in source:
        raise PrecompileError(
            f"internal: Inductor's generated wrapper imports no AsyncCompile (torch "
            f"{torch.__version__}); this torch release is not supported by this "
            "torch-precompile yet. Use backend='eager'."
        )
    source = _replace_once(
        source, "\nasync_compile = AsyncCompile()\n", f"\nasync_compile = {loader}\n"
    )
    return _replace_once(source, "\ncall = runner.call\n", "\ninductor_call = runner.call\n")


_LOADER_WIDTH = re.compile(
    r"(= KernelLoader\(globals\(\)\.get\('PRECOMPILED_KERNELS', \{\}\), "
    r"vector_bits=\d+)\)\n"
)


def loader_resolving_now(graph_source: str) -> str:
    """A graph's source whose kernel loader readies each kernel as it hands it out, for a
    graph that runs inside a function (see ``KernelLoader``)."""
    source, count = _LOADER_WIDTH.subn(r"\1, resolve_now=True)\n", graph_source)
    if count == 0 and "resolve_now=True)" in graph_source:
        return source  # graphs inside it that ready their kernels already (lower.regions)
    if count != 1:
        raise PrecompileError("internal: a graph's source creates no kernel loader, or several")
    return source


def _cpp_wrapper_with_stand_ins(wrapper: str, loader: str) -> str:
    """A C++ wrapper module whose shared object comes from the kernel loader: prebuilt from
    the cache, else built here from ``cpp_wrapper_src``."""
    source = _replace_once(
        wrapper,
        "\nfrom torch._inductor.codecache import CppWrapperCodeCache\n",
        f"\nCppWrapperCodeCache = {loader}\n",
    )
    if _INDUCTOR_IMPORT.search(source):
        raise PrecompileError(
            "internal: Inductor's C++ wrapper module imports more of torch._inductor than "
            f"this torch-precompile replaces (torch {torch.__version__}). Use wrapper='python'."
        )
    source = _replace_once(
        source,
        "\ncall = _wrap_func(inductor_entry)\n",
        "\ninductor_call = _wrap_func(inductor_entry)\n",
    )
    return _with_direct_handles(source)


# Inductor's own glue walks the inputs in Python one by one (to convert any that is not a
# tensor), which on a graph of many small inputs costs more per call than the whole entry.
_DIRECT_HANDLES = """\
# In place of Inductor's glue: the inputs go to the entry as they are (the driver passes
# tensors), converted one by one only where one is a Python number.
def _wrap_func(f):
    def g(args):
        try:
            input_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(args)
        except TypeError:  # a Python number among the inputs: passed as a tensor
            input_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(
                [a if isinstance(a, torch.Tensor) else torch.tensor(a, device='cpu')
                 for a in args])
        args.clear()
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(f(input_handles))

    return g
"""


def _with_direct_handles(source: str) -> str:
    """The module with ``_DIRECT_HANDLES`` for Inductor's ``_wrap_func``, where that one only
    converts tensors to handles and back (no Python-only inputs, constants or scalar results)."""
    tree = ast.parse(source)
    glue = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_wrap_func"]
    if len(glue) != 1 or glue[0].end_lineno is None:
        return source
    lines = source.splitlines(keepends=True)
    start, end = glue[0].lineno - 1, glue[0].end_lineno
    text = "".join(lines[start:end])
    tensors_only = (
        "python_only_input_indices" not in text or "python_only_input_indices = set()" in text
    )
    if not (tensors_only and "return output_tensors" in text and "constants_tensor" not in text):
        return source
    return "".join([*lines[:start], _DIRECT_HANDLES, *lines[end:]])


def built_kernel_object(
    argtypes: list[str], source: str, options: dict[str, Any]
) -> tuple[str, Path]:
    """The module name and shared-object path of a C++ kernel Inductor just built."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    function = CppPythonBindingsCodeCache.load_pybinding(argtypes, source, **options)
    return function.__self__.__name__.rpartition(".")[2], Path(function.__self__.__file__)


def built_wrapper_object(
    argtypes: list[str], source: str, options: dict[str, Any]
) -> tuple[str, Path]:
    """The module name and shared-object path of the C++ wrapper, built here (Inductor's own
    build was skipped: see ``_cpp_wrapper_left_unbuilt``)."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    with _units_built_side_by_side(codecache), inductor_config.patch(INDUCTOR_OPTIONS):
        function = codecache.CppWrapperCodeCache.load_pybinding(
            argtypes=argtypes, main_code=source, **options
        )
    return function.__self__.__name__.rpartition(".")[2], Path(function.__self__.__file__)


@contextlib.contextmanager
def _units_built_side_by_side(codecache: Any) -> Iterator[None]:
    """Inductor compiles a C++ wrapper's glue and its kernels (two compiler runs) one after
    the other, then links them. They are independent: here they run at once, where the
    machine has a core for each."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    serial = codecache._worker_compile_cpp

    def side_by_side(lock_path: str, builders: Any) -> None:
        *units, link = builders
        if len(units) < 2 or (os.cpu_count() or 1) < 2:
            return cast(None, serial(lock_path, builders))
        from torch.utils._filelock import FileLock

        with FileLock(lock_path, timeout=codecache.LOCK_TIMEOUT):
            todo = [b for b in units if not os.path.exists(b.get_target_file_path())]
            with ThreadPoolExecutor(max_workers=max(len(todo), 1)) as pool:
                for done in [pool.submit(b.build) for b in todo]:
                    done.result()
            if not os.path.exists(link.get_target_file_path()):
                link.build()
        return None

    codecache._worker_compile_cpp = side_by_side
    try:
        yield
    finally:
        codecache._worker_compile_cpp = serial


def cpp_wrapper_build(wrapper_source: str) -> tuple[list[str], str, dict[str, Any]] | None:
    """How a C++ wrapper module builds its shared object: (argtypes, source, options) of its
    ``CppWrapperCodeCache.load_pybinding(...)``; None for a Python wrapper."""
    if not is_cpp_wrapper(wrapper_source):
        return None
    tree = ast.parse(wrapper_source)
    # Module-level strings the call names: the wrapper's source, and (built separately) the
    # kernels' source.
    strings = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }

    def value(node: ast.expr) -> Any:
        return strings[node.id] if isinstance(node, ast.Name) else ast.literal_eval(node)

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func) == _CPP_WRAPPER_BUILD
            and not node.args
        ):
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            if (
                isinstance(keywords.get("main_code"), ast.Name)
                and cast(ast.Name, keywords["main_code"]).id == _CPP_WRAPPER_SOURCE
            ):
                options = {
                    k: value(v) for k, v in keywords.items() if k not in ("argtypes", "main_code")
                }
                return (
                    ast.literal_eval(keywords["argtypes"]),
                    cpp_wrapper_source(wrapper_source),
                    options,
                )
    raise PrecompileError(
        f"internal: Inductor's C++ wrapper module does not build {_CPP_WRAPPER_SOURCE} in the "
        f"expected form (torch {torch.__version__}); this torch release is not supported yet. "
        "Use wrapper='python'."
    )


def cpp_kernel_calls(wrapper_source: str) -> list[tuple[list[str], str, dict[str, Any]]]:
    """The ``async_compile.cpp_pybinding(...)`` calls of a wrapper: (argtypes, source, options)."""
    calls = []
    for node in ast.walk(ast.parse(wrapper_source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "cpp_pybinding"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "async_compile"
        ):
            args = [ast.literal_eval(a) for a in node.args]
            options = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            calls.append((args[0], args[1], options))
    if wrapper_source.count("async_compile.cpp_pybinding(") != len(calls):
        raise PrecompileError(
            "internal: some C++ kernels of Inductor's generated wrapper are not in the "
            f"expected form async_compile.cpp_pybinding(argtypes, source) (torch "
            f"{torch.__version__}); this torch release is not supported yet. Use "
            "backend='eager'."
        )
    return calls
