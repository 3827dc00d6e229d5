"""Loading an artifact again and again: no process-wide hook or memory piles up, a dropped
artifact is freed, and the model memo still sees every registration. Each check runs in a
fresh interpreter, so hooks and memory left by other tests do not blur it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_python

NAME = "mlp_infer"
LOADS = 1000

# Shared by the scripts below: the pairs, the example call, what registration hooks exist.
_PROLOGUE = """
    import gc, json, logging, os, sys, weakref
    import torch
    from torch_precompile import PrecompileError, precompile
    from workloads import WORKLOADS
    logging.getLogger("torch_precompile").setLevel(logging.ERROR)  # load's warning, each load
    pairs = [(open(code).read(), open(cache, "rb").read()) for code, cache in {paths!r}]
    model, x = WORKLOADS[{name!r}].args()
    registry = torch.nn.modules.module

    def hooks():
        return [len(registry._global_parameter_registration_hooks),
                len(registry._global_buffer_registration_hooks),
                len(registry._global_module_registration_hooks)]
"""

_MANY_LOADS = (
    _PROLOGUE
    + """
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    code, cache = pairs[0]
    expected = model(x)

    def rss_mib():
        return (int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                / 2**20)

    def load_and_call():
        torch.testing.assert_close(precompile.load(code, cache)(model, x), expected)

    fresh = hooks()
    for _ in range(20):
        load_and_call()
    gc.collect()
    gc.freeze()  # what lives now is never collected: the collections below walk only the new
    warm, before = hooks(), rss_mib()
    for i in range({loads}):
        load_and_call()
        # A dropped artifact is a module namespace, cyclic garbage that waits for a full
        # collection; collecting often keeps that wait out of the measure.
        if i % 10 == 9:
            gc.collect()
    gc.collect()
    print(json.dumps({{"fresh": fresh, "warm": warm, "after": hooks(),
                      "growth_mib": rss_mib() - before}}))
"""
)

_DROPPED = (
    _PROLOGUE
    + """
    kept = []
    for code, cache in pairs:
        run = precompile.load(code, cache)
        run(model, x)
        kept.append(weakref.ref(run._forward))  # the namespace holds forward
        del run
    gc.collect()
    alive = [ref() for ref in kept if ref() is not None]
    print(json.dumps({{"alive": len(alive),
                      "referrers": [type(r).__name__ for a in alive for r in gc.get_referrers(a)],
                      "hooks": hooks()}}))
"""
)

_REGISTERED = (
    _PROLOGUE
    + """
    runs = [precompile.load(code, cache) for code, cache in pairs for _ in range(3)]
    for run in runs:
        run(model, x)
        run(model, x)  # the models are remembered now

    def results():
        return [run(model, x) for run in runs]

    # Same shape: only the registration tells the memo the weight is another tensor.
    model.fc1.weight = torch.nn.Parameter(torch.randn_like(model.fc1.weight))
    runs += [precompile.load(code, cache) for code, cache in pairs]  # loads after it count too
    for got in results():
        torch.testing.assert_close(got, model(x))
    model.fc1.weight = torch.nn.Parameter(torch.randn(8, 5))
    refused = 0
    for run in runs:
        try:
            run(model, x)
        except PrecompileError:
            refused += 1
    print(json.dumps({{"runs": len(runs), "refused": refused}}))
"""
)


def _paths(tmp_path: Path, artifacts, backends: list[str]) -> list[tuple[str, str]]:
    paths = []
    for backend in backends:
        code, cache = artifacts.pair(NAME, backend)
        code_path, cache_path = tmp_path / f"{backend}.py", tmp_path / f"{backend}.cache"
        code_path.write_text(code)
        cache_path.write_bytes(cache)
        paths.append((str(code_path), str(cache_path)))
    return paths


def _run(script: str) -> dict:
    proc = run_python(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
@pytest.mark.timeout(300)  # about 15 s a backend, once the inductor pair is built
def test_repeated_loads_add_no_hook_and_no_memory(tmp_path, artifacts, backend: str) -> None:
    paths = _paths(tmp_path, artifacts, [backend])
    found = _run(_MANY_LOADS.format(paths=paths, name=NAME, loads=LOADS))
    # One hook of each kind for the whole process, added by the first load.
    assert all(
        warm <= fresh + 1 for warm, fresh in zip(found["warm"], found["fresh"], strict=True)
    ), found
    assert found["after"] == found["warm"], found
    assert found["growth_mib"] < 5, found


def test_a_dropped_artifact_is_freed(tmp_path, artifacts) -> None:
    paths = _paths(tmp_path, artifacts, ["eager", "inductor"])
    found = _run(_DROPPED.format(paths=paths, name=NAME))
    assert found["alive"] == 0, found
    assert found["hooks"] == [1, 1, 1], found


def test_the_memo_sees_registrations_with_several_artifacts_loaded(tmp_path, artifacts) -> None:
    paths = _paths(tmp_path, artifacts, ["eager", "inductor"])
    found = _run(_REGISTERED.format(paths=paths, name=NAME))
    assert found == {"runs": 8, "refused": 8}
