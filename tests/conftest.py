"""Shared fixtures: artifacts are built once per (workload, backend) and reused by many tests."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The suite makes hundreds of builds on one machine: precompiled C++ headers pay for
# themselves there (set before torch_precompile reads it; child processes inherit it).
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")

import pytest
import torch
import torch.utils._pytree as pytree

from torch_precompile import precompile

from workloads import WORKLOADS

BACKENDS = ["eager", "inductor"]
TESTS_DIR = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("TORCH_PRECOMPILE_TEST_TRACER") == "dynamo":
        _capture_with_dynamo()
    config.addinivalue_line(
        "markers",
        "release_independent: exercises only the package's own file handling; "
        ".ci/matrix leaves it to the default release's run",
    )
    config.addinivalue_line(
        "markers",
        "soak: a long run (many steps, loads or threads); .ci/matrix leaves it to "
        "the default release's run",
    )
    config.addinivalue_line(
        "markers",
        "default_release: set by conftest on the package's own logic (ONE_RELEASE_FILES) and "
        "on the inductor twin of a driver check (EAGER_TWIN_FILES); .ci/matrix leaves it to "
        "the default release's run",
    )
    config.addinivalue_line(
        "markers",
        "lowering: in a file of the driver's checks (EAGER_TWIN_FILES), a test whose inductor "
        "twin is kept, because Inductor's lowering (random draws, writes in place, layouts, "
        "backward graphs, optimizer steps, kernel caches) is what it checks",
    )


# Files that test the package's own logic (its CLI, reports, files, signing, threads, the plain
# driver's generated code, capture blocks): torch's release changes nothing they exercise
# beyond what the rest of the suite runs on every release.
ONE_RELEASE_FILES = frozenset(
    {
        "test_cli.py",
        "test_concurrency.py",
        "test_reports.py",
        "test_serving.py",
        "test_tamper.py",
        "test_kernel_pins.py",
        "test_progress.py",
        "test_provenance.py",
        "test_spec_schema.py",
        "test_call_watch.py",
        "test_load_leak.py",
        "test_fuzz.py",
        "test_plain_artifact.py",
        "test_capture_session.py",
        "test_house.py",
        "test_values.py",
    }
)
# Files of the driver's checks (what fn read, refused calls, layouts): a check is the same
# generated code for both backends, so these tests run on the eager backend, and only those
# marked ``lowering`` have an inductor twin too (on the default release; the lowering itself is
# covered on every release by the files that test Inductor: artifact, models, golden, kernel
# cache, C++ wrapper, dynamic dims, distributed).
EAGER_TWIN_FILES = frozenset(
    {
        "test_trace_facts.py",
        "test_value_reads.py",
        "test_python_state.py",
        "test_semantics.py",
        "test_runtime_checks.py",
        "test_guards.py",
        "test_tensor_reads.py",
        "test_layout.py",
        "test_load.py",
        "test_storage.py",
        # The same small graphs as the files above, under other entry points and forms.
        "test_api.py",
        "test_capture.py",
        "test_compiled_module.py",
        "test_differentiable.py",
        "test_dynamo_tracer.py",
        "test_trainer.py",
        "test_variants.py",
        # Inductor lowers AdamW steps on every release in the distributed worlds, and
        # quantized weights in this file's tests that take no backend parameter.
        "test_optimizers.py",
        "test_subclasses.py",
    }
)

# Tests elsewhere whose inductor twin runs once: test_gpt2 lowers a transformers model with
# Inductor on every release, and pooling is lowered there by its inference test.
EAGER_TWIN_TESTS = frozenset(
    {"test_t5_inference", "test_t5_training_step", "test_max_pooling_training_step"}
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``backend``: both, except in a file of the driver's checks, where only a test marked
    ``lowering`` gets its inductor twin."""
    if "backend" not in metafunc.fixturenames or _backend_given(metafunc):
        return
    eager_only = metafunc.definition.path.name in EAGER_TWIN_FILES and not (
        metafunc.definition.get_closest_marker("lowering")
    )
    metafunc.parametrize("backend", ["eager"] if eager_only else BACKENDS)


def _backend_given(metafunc: pytest.Metafunc) -> bool:
    """Whether the test parametrizes ``backend`` itself."""
    return any("backend" in m.args[0] for m in metafunc.definition.iter_markers("parametrize"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        params = getattr(item, "callspec", None)
        twin = params is not None and "inductor" in params.id.split("-")
        twin_once = name in EAGER_TWIN_FILES or getattr(item, "originalname", "") in (
            EAGER_TWIN_TESTS
        )
        if name in ONE_RELEASE_FILES or (twin and twin_once):
            item.add_marker(pytest.mark.default_release)


def _capture_with_dynamo() -> None:
    """Every capture of the run reads fn with Dynamo too (``tracer="dynamo"``), to run the
    suite's cases through that tracer: TORCH_PRECOMPILE_TEST_TRACER=dynamo pytest ..."""
    import torch_precompile.trace as trace

    plain = trace.capture

    def capture(*args: Any, tracer: str = "make_fx", **kwargs: Any) -> Any:
        return plain(*args, tracer="dynamo", **kwargs)

    trace.capture = capture  # type: ignore[assignment]


class Artifacts:
    """Builds each workload's artifact pair once per backend, for the whole session."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, str, str, bool], tuple[str, bytes]] = {}

    def pair(
        self, name: str, backend: str, wrapper: str = "auto", inference: bool = False
    ) -> tuple[str, bytes]:
        """``inference``: built under no_grad, as a server builds (no backward graphs)."""
        key = (name, backend, wrapper, inference)
        if key not in self._built:
            workload = WORKLOADS[name]
            options = {"wrapper": wrapper} if wrapper != "auto" else {}
            with torch.no_grad() if inference else contextlib.nullcontext():
                self._built[key] = precompile(
                    workload.fn, *workload.args(), backend=backend, **options
                )
        return self._built[key]

    def load(
        self, name: str, backend: str, wrapper: str = "auto", inference: bool = False
    ) -> Callable[..., Any]:
        return precompile.load(*self.pair(name, backend, wrapper, inference))


@pytest.fixture(scope="session")
def artifacts() -> Artifacts:
    return Artifacts()


def assert_same(actual: Any, expected: Any, *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Same pytree structure; tensors close; other leaves equal."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"structure differs: {a_spec} vs {e_spec}"
    for a, e in zip(a_leaves, e_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor)
            assert a.shape == e.shape and a.dtype == e.dtype
            torch.testing.assert_close(a, e.detach(), rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert a == e


def model_state(*modules: torch.nn.Module) -> dict[str, Any]:
    """Parameters, their .grad fields, and buffers of ``modules``, for comparisons."""
    state: dict[str, Any] = {}
    for i, m in enumerate(modules):
        for name, p in m.named_parameters():
            state[f"{i}.{name}"] = p.detach().clone()
            state[f"{i}.{name}.grad"] = None if p.grad is None else p.grad.clone()
        for name, b in m.named_buffers():
            state[f"{i}.{name}"] = b.clone()
    return state


FRESH_SEED = 1  # WORKLOADS' weights and inputs other than the capture's example (seed 0)


def run_eager_and_compiled(
    name: str, run: Callable[..., Any], calls: int = 1, seed: int = FRESH_SEED
) -> tuple[list[Any], list[Any], tuple[Any, ...], tuple[Any, ...]]:
    """Run the eager fn and the artifact side by side on identical copies of new weights and
    inputs (``seed``; 0 would be the capture's own example); return both."""
    workload = WORKLOADS[name]
    args = workload.args(seed)
    eager_args, compiled_args = copy.deepcopy(args), copy.deepcopy(args)
    eager_out = [workload.fn(*eager_args) for _ in range(calls)]
    compiled_out = [run(*compiled_args) for _ in range(calls)]
    return eager_out, compiled_out, eager_args, compiled_args


def modules_in(args: tuple[Any, ...]) -> list[torch.nn.Module]:
    return [a for a in args if isinstance(a, torch.nn.Module)]


def assert_runs_like_eager(run: Callable[..., Any], name: str, calls: int = 1) -> None:
    """``run`` and eager ``fn`` on new weights and inputs: same results and model state."""
    eager_out, compiled_out, eager_args, compiled_args = run_eager_and_compiled(name, run, calls)
    assert_same(compiled_out, eager_out)
    assert_same(model_state(*modules_in(compiled_args)), model_state(*modules_in(eager_args)))


def run_python(
    script: str,
    *,
    block_package: bool = False,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter; with ``block_package``, torch_precompile
    cannot be imported there. An existing PYTHONPATH (a checkout under test) comes first,
    then this directory (for ``workloads``)."""
    prologue = "import sys\n"
    if block_package:
        prologue += "sys.modules['torch_precompile'] = None  # importing it now fails\n"
    path = [*filter(None, [os.environ.get("PYTHONPATH")]), str(TESTS_DIR)]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


# Fresh-process loads of an inductor pair (the kernel cache and C++ wrapper tests).
COMPILERS = ["gcc", "g++", "cc", "c++", "clang", "clang++"]

FRESH_LOAD = """
    import json, os, sys, torch
    from torch_precompile import precompile
    from workloads import WORKLOADS
    code = open({code!r}).read()
    cache = open({cache!r}, "rb").read()
    run = precompile.load(code, cache)
    args = WORKLOADS[{name!r}].args(1)
    result = run(*args)
    expected = torch.load({expected!r})
    torch.testing.assert_close(result, expected)
    build_time = [name for name in sys.modules if name.startswith((
        "torch_precompile.trace", "torch_precompile.lower", "torch_precompile.internals.tracing",
        "torch_precompile.internals.inductor"))]
    print(json.dumps({{"inductor_imported": "torch._inductor" in sys.modules,
                      "build_time_modules": build_time}}))
"""


def poisoned_toolchain(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """PATH and CXX pointing at compilers that record being called and fail."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "compiler-was-called"
    for name in COMPILERS:
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "$0 $@" >> {marker}\nexit 1\n')
        tool.chmod(0o755)
    cache_dir, tmp_dir = tmp_path / "inductor-cache", tmp_path / "tmp"
    cache_dir.mkdir()
    tmp_dir.mkdir()
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "CXX": str(bin_dir / "g++"),
        "CC": str(bin_dir / "gcc"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TMPDIR": str(tmp_dir),
    }
    return env, marker


def write_pair(tmp_path: Path, name: str, code: str, cache: bytes) -> dict[str, str]:
    """The pair and eager's result on ``WORKLOADS[name].args(FRESH_SEED)`` (new weights and
    inputs), as files for a fresh process."""
    workload = WORKLOADS[name]
    expected = workload.fn(*workload.args(FRESH_SEED))
    paths = {
        "code": tmp_path / "a.py",
        "cache": tmp_path / "a.cache",
        "expected": tmp_path / "expected.pt",
    }
    paths["code"].write_text(code)
    paths["cache"].write_bytes(cache)
    torch.save(expected, paths["expected"])
    return {k: str(v) for k, v in paths.items()}


def kernel_payload(code: str, cache: bytes) -> dict[str, Any]:
    """The kernel payload of an inductor pair's cache, as ``read_payload`` gives it."""
    from torch_precompile.artifact import envelope
    from torch_precompile.artifact.kernel_payload import read_payload

    return read_payload(envelope.unpack(cache, "inductor", code))


def with_kernel_payload(code: str, payload: dict[str, Any]) -> bytes:
    """A cache for ``code`` holding ``payload`` (edited, say), in the payload's torch.save
    layout, which load still reads."""
    import io

    from torch_precompile.artifact import envelope

    buffer = io.BytesIO()
    torch.save({**payload, "version": 1}, buffer)
    return envelope.pack("inductor", code, buffer.getvalue())


def in_threads(work: Callable[[int], Any], count: int) -> list[BaseException]:
    """Run ``work(i)`` in ``count`` threads at once; the exceptions they raised."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    errors.extend(
        TimeoutError(f"{t.name} still running after 600 s") for t in threads if t.is_alive()
    )
    return errors


def stderr_on_a_terminal(command: list[str], **run_options: Any) -> tuple[int, str]:
    """Run ``command`` with its stderr on a pseudo-terminal: (exit status, what it showed)."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=follower, **run_options)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closes once the process is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    return proc.returncode, b"".join(chunks).decode()


# Distributed runs: one process per rank, on gloo over 127.0.0.1, each writing a report.
WORKER_TIMEOUT_S = 900


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world: int, cases: list[str], out: Path, worker: str = "distributed_worker.py"
) -> list[dict[str, Any]]:
    """Run ``worker`` (``RANK WORLD PORT OUT CASES``) on ``world`` ranks; each rank's report."""
    import json

    port = free_port()
    launch(
        [
            [
                sys.executable,
                str(TESTS_DIR / worker),
                str(rank),
                str(world),
                str(port),
                str(out),
                ",".join(cases),
            ]
            for rank in range(world)
        ],
        [out / f"log{rank}" for rank in range(world)],
        distributed_env(),
        WORKER_TIMEOUT_S,
    )
    reports = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        assert path.exists(), (out / f"log{rank}").read_text()[-3000:]
        reports.append(json.loads(path.read_text()))
    return reports


def distributed_env(**extra: str) -> dict[str, str]:
    """The environment of a rank: gloo on the loopback device, this directory importable."""
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        **extra,
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }


def launch(
    commands: list[list[str]], logs: list[Path], env: dict[str, str], timeout: float
) -> list[int]:
    """Run ``commands`` at once, each writing to its log; wait for all (killing any left after
    ``timeout``); their exit statuses."""
    files = [open(log, "w") for log in logs]  # noqa: SIM115
    procs = [
        subprocess.Popen(command, stdout=file, stderr=subprocess.STDOUT, env=env)
        for command, file in zip(commands, files, strict=True)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            proc.kill()
        for file in files:
            file.close()
    return [proc.returncode for proc in procs]
