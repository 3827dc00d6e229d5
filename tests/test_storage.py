"""Artifact pairs on disk, and signatures."""

from __future__ import annotations

import builtins
import itertools
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torch_precompile import PrecompileError, precompile
from torch_precompile.artifact import envelope
from torch_precompile.storage import cache_path

from conftest import assert_runs_like_eager
from workloads import WORKLOADS

# The inductor twin of each test here is kept: Inductor's lowering is part of what it checks.
pytestmark = pytest.mark.lowering

KEY = b"correct horse battery staple"


@pytest.fixture
def pair(backend: str, artifacts) -> tuple[str, bytes]:
    return artifacts.pair("mlp_infer", backend)


def _runs(run) -> None:
    assert_runs_like_eager(run, "mlp_infer")


def test_save_and_load_file(pair, tmp_path) -> None:
    code, cache = pair
    path = precompile.save(code, cache, tmp_path / "mlp.py")
    assert path.read_text() == code
    assert cache_path(path, code).read_bytes() == cache
    assert cache_path(path, code).name.startswith("mlp.") and path.suffix == ".py"
    _runs(precompile.load_file(path))


def test_resave_replaces_the_pair_and_keeps_one_previous_cache(
    pair, artifacts, backend, tmp_path
) -> None:
    code, cache = pair
    other_code, other_cache = artifacts.pair("mlp_train", backend)
    path = tmp_path / "m.py"
    precompile.save(code, cache, path)
    precompile.save(other_code, other_cache, path)
    precompile.save(code, cache, path)
    caches = sorted(p.name for p in tmp_path.glob("m.*.cache"))
    assert caches == sorted({cache_path(path, code).name, cache_path(path, other_code).name})
    _runs(precompile.load_file(path))


def test_missing_cache_warns_and_runs(pair, tmp_path, caplog) -> None:
    code, cache = pair
    path = precompile.save(code, cache, tmp_path / "m.py")
    cache_path(path, code).unlink()
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = precompile.load_file(path)
    assert any("no cache beside" in r.message for r in caplog.records)
    _runs(run)


def test_save_refuses_what_is_not_an_artifact(pair, tmp_path) -> None:
    code, cache = pair
    with pytest.raises(PrecompileError, match="not a precompile artifact"):
        precompile.save("print('hi')\n", cache, tmp_path / "x.py")
    with pytest.raises(PrecompileError, match="is not a directory"):
        precompile.save(code, cache, tmp_path / "missing" / "x.py")
    with pytest.raises(PrecompileError, match="no artifact at"):
        precompile.load_file(tmp_path / "absent.py")


def test_signed_pairs(pair, tmp_path) -> None:
    code, cache = pair
    path = precompile.save(code, cache, tmp_path / "m.py", sign_key=KEY)
    _runs(precompile.load_file(path, verify_key=KEY))
    _runs(precompile.load_file(path))  # no key: as before
    with pytest.raises(PrecompileError, match="signature does not match"):
        precompile.load_file(path, verify_key=b"another key")
    unsigned = precompile.save(code, cache, tmp_path / "u.py")
    with pytest.raises(PrecompileError, match="not signed"):
        precompile.load_file(unsigned, verify_key=KEY)


def test_precompile_signs_in_memory(backend: str) -> None:
    model, x = WORKLOADS["mlp_infer"].args()
    code, cache = precompile(WORKLOADS["mlp_infer"].fn, model, x, backend=backend, sign_key=KEY)
    _runs(precompile.load(code, cache, verify_key=KEY))
    with pytest.raises(PrecompileError, match="no cache"):
        precompile.load(code, None, verify_key=KEY)
    with pytest.raises(PrecompileError, match="sign_key must be non-empty bytes"):
        precompile(WORKLOADS["mlp_infer"].fn, model, x, backend=backend, sign_key="text")


def test_verification_comes_before_anything_runs(
    pair, backend: str, tmp_path, monkeypatch, caplog
) -> None:
    """With verify_key, a changed or unsigned pair is refused for that reason, before any of
    its source runs or any of its cache is read."""
    code, cache = pair
    marker = tmp_path / "executed"
    hostile = f"open({str(marker)!r}, 'w').close()\n" + code
    opened: list[Any] = []
    real_read = envelope.read

    def recording_read(*args: Any, **kwargs: Any) -> Any:
        opened.append(args)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(envelope, "read", recording_read)
    # The probes work: paired with its own cache and loaded without a key, the hostile
    # source runs (the marker appears) and its cache is read.
    acceleration = envelope.unpack(cache, backend, code)
    precompile.load(hostile, envelope.pack(backend, hostile, acceleration))
    assert marker.exists() and opened
    marker.unlink()
    opened.clear()

    precompile.save(code, cache, tmp_path / "m.py", sign_key=KEY)
    signed = cache_path(tmp_path / "m.py", code).read_bytes()
    signed_by_another = precompile.save(
        hostile,
        envelope.pack(backend, hostile, acceleration),
        tmp_path / "h.py",
        sign_key=b"the attacker's key",
    )
    cases = [  # the first two are consistent pairs: only the signature can stop them
        (hostile, envelope.pack(backend, hostile, acceleration), "the artifact is not signed"),
        (
            hostile,
            cache_path(signed_by_another, hostile).read_bytes(),
            "signature does not match",
        ),  # signed, with another key
        (hostile, signed, "signature does not match"),  # the source changed after signing
        (code, signed[:-1] + b"x", "signature does not match"),  # the cache changed
    ]
    for candidate_code, candidate_cache, message in cases:
        caplog.clear()
        opened.clear()
        with (
            caplog.at_level(logging.WARNING, logger="torch_precompile"),
            pytest.raises(PrecompileError, match=rf"{message}.*[Nn]othing was executed"),
        ):
            precompile.load(candidate_code, candidate_cache, verify_key=KEY)
        assert not marker.exists(), f"refused ({message}), but its source ran"
        assert opened == [], f"refused ({message}), but its cache was read"
        assert not [r for r in caplog.records if "executing python_code" in r.getMessage()]


def _generation(base: str, i: int) -> tuple[str, bytes]:
    """A distinct, valid pair per save: old caches can never stand in for a new source."""
    code = f"{base}# generation {i}\n"
    return code, envelope.pack("eager", code, b"\0" * (2 << 20))


# The system calls a save makes, each a point where a writer may die.
_SAVE_STEPS = ((os, "open"), (os, "fsync"), (os, "replace"), (os, "unlink"), (builtins, "open"))


def _counting_steps(on_step: Callable[[int], None]) -> None:
    """Patch every save step to call ``on_step(n)`` (n counts from 0) before it runs."""
    counter = itertools.count()
    for module, name in _SAVE_STEPS:
        real = getattr(module, name)

        def step(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            on_step(next(counter))
            return _real(*args, **kwargs)

        setattr(module, name, step)


def _steps_of_one_save(base: str, target: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    steps: list[int] = []
    with monkeypatch.context() as patched:
        for module, name in _SAVE_STEPS:
            patched.setattr(module, name, getattr(module, name))  # restored on exit
        _counting_steps(steps.append)
        precompile.save(*_generation(base, 0), target)
    return len(steps)


def _killed_writer(base: str, target: Path, start: int, kill_at: int) -> None:
    """Fork a writer that saves generation after generation over ``target`` and is SIGKILLed
    just before its ``kill_at``-th system call; wait for it."""
    pid = os.fork()
    if pid == 0:  # the writer: never returns
        try:

            def die_at(n: int) -> None:
                if n == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            _counting_steps(die_at)
            for i in itertools.count(start):
                precompile.save(*_generation(base, i), target)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


@pytest.mark.release_independent
def test_kill_at_any_moment_leaves_a_whole_pair(artifacts, tmp_path, monkeypatch) -> None:
    """A writer killed before each system call of its saves, one by one: what is on disk is
    always one whole pair, the last one saved, and it loads."""
    base, _ = artifacts.pair("mlp_infer", "eager")
    target = tmp_path / "model.py"
    per_save = _steps_of_one_save(base, target, monkeypatch)
    assert per_save >= 4, per_save
    landed = []
    for kill_at in range(2 * per_save):  # every step of two saves: over none, then over one
        start = (kill_at + 1) * 100_000
        _killed_writer(base, target, start, kill_at)
        code = target.read_text()
        generation = int(code.rsplit("# generation ", 1)[1])
        assert cache_path(target, code).read_bytes() == _generation(base, generation)[1]
        assert generation <= start + 1, generation  # the second save never got far
        landed.append(generation >= start)
        precompile.load_file(target)  # a mismatched pair would raise here
    # Killed early, the previous pair stays; killed late, the new one is whole.
    assert not landed[0] and landed[-1], landed
