"""Real artifacts of every schema version: inspect reads each, load takes those it can read.

The pairs under tests/golden/ were made by earlier versions of this package (see its README)
and are never rewritten; a new schema version cannot land without its own pair for every
supported torch release. Each pair is run under the release it was made with, in a fresh
process (one for all the pairs of that release), against the inputs and expected outputs
stored beside it; under any other release it must be refused.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

from torch_precompile import PrecompileError, precompile, spec
from torch_precompile.inspection import describe
from torch_precompile.internals import torch_build
from torch_precompile.spec import versions

from conftest import run_python

GOLDEN = Path(__file__).parent / "golden"
PAIRS = sorted(GOLDEN.glob("schema*-*.artifact"))
ROOT = Path(__file__).resolve().parents[1]
INTEGER_ERA = "2.13.0"  # every pair of the versions written as one integer was made under it


def supported_releases() -> list[str]:
    """The torch releases CI runs on: the Makefile's, then those of .ci/matrix."""
    first = re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    matrix = re.search(r"^MATRIX=\((.*)\)$", (ROOT / ".ci" / "matrix").read_text(), re.MULTILINE)
    assert first and matrix
    return [first[1], *(pair.strip('"').split(":")[0] for pair in matrix[1].split())]


def _parts(path: Path) -> tuple[spec.SchemaVersion, str, str]:
    """A pair's schema version, backend and the torch release it was made under."""
    found = re.fullmatch(
        r"schema(\d+)(?:\.(\d+))?-(eager|inductor)(?:-torch([\d.]+))?\.artifact", path.name
    )
    assert found, path
    version = (int(found[1]), int(found[2] or 0))
    return version, found[3], found[4] or INTEGER_ERA


def _version(path: Path) -> spec.SchemaVersion:
    return _parts(path)[0]


def test_every_readable_version_has_a_golden_pair_per_backend_and_release() -> None:
    found = {_parts(path) for path in PAIRS}
    for change in spec.SCHEMA_HISTORY:
        if change.version < spec.OLDEST_READABLE_SCHEMA:
            continue
        releases = [INTEGER_ERA] if change.version < (10, 0) else supported_releases()
        for backend in ("eager", "inductor"):
            for release in releases:
                assert (change.version, backend, release) in found, (
                    f"schema version {spec.shown_version(change.version)} has no golden "
                    f"{backend} pair made under torch {release}: run "
                    "`python tests/golden/make_golden.py` with the checkout that writes it, "
                    "in that release's environment"
                )


def _make_golden() -> ModuleType:
    """tests/golden/make_golden.py, the script that wrote the pairs and their expected outputs."""
    found = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.name)
def test_every_pair_stores_its_inputs_and_expected_outputs(path: Path) -> None:
    """The stored inputs are make_golden's (its weights and calls, two variants from schema 7),
    and the stored outputs are eager's for them: each call's loss, run in order on one model,
    and the gradients on .grad after the last."""
    expected = torch.load(path.with_suffix(".expected.pt"), weights_only=True)
    assert len(expected["calls"]) == len(expected["losses"]) >= 2
    assert len(expected["grads"]) == 4 and set(expected["state"]) == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    }
    golden = _make_golden()
    variants = 2 if _version(path) >= (7, 0) else 1
    model = golden.golden_model()
    torch.testing.assert_close(expected["state"], model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(expected["calls"], golden.golden_calls(variants), rtol=0, atol=0)
    model.load_state_dict(expected["state"])
    losses = [golden.train_step(model, x, target) for x, target in expected["calls"]]
    torch.testing.assert_close(expected["losses"], losses, rtol=1e-5, atol=1e-6)
    grads = [p.grad for p in model.parameters()]
    torch.testing.assert_close(expected["grads"], grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.name)
def test_inspect_reads_every_golden_pair(path: Path) -> None:
    code = path.read_text()
    read = precompile.inspect(code)
    assert read.schema_version == _version(path)
    assert read.backend == _parts(path)[1]
    assert [a.name for a in read.args] == ["model", "x", "target"]
    assert [t.name for t in read.parameters] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    report = describe(path)
    assert report["call"] == "forward(model, x, target)"
    assert report["source"]["schema_version"] == spec.shown_version(_version(path))


# One fresh process runs every pair made under the running release, one after the other as
# a server loading several artifacts would, and says for each whether it matched.
_RUN_GOLDEN = """
    import json, sys, traceback, torch
    sys.path.insert(0, {golden!r})
    from make_golden import golden_model
    from torch_precompile import precompile

    def check(path, expected_path):
        run = precompile.load_file(path)
        expected = torch.load(expected_path, weights_only=True)
        model = golden_model()
        model.load_state_dict(expected["state"])
        # Each pair runs every call its variants serve (older pairs hold one variant).
        calls = expected["calls"][: 3 if run.spec.variants else 2]
        for (x, target), loss in zip(calls, expected["losses"]):
            torch.testing.assert_close(run(model, x, target), loss, rtol=1e-5, atol=1e-6)
        grads = expected["grads"] if len(calls) == len(expected["calls"]) else None
        for p, grad in zip(model.parameters(), grads or []):
            torch.testing.assert_close(p.grad, grad, rtol=1e-5, atol=1e-6)
        assert grads is not None or not run.spec.variants

    for path, expected_path in {pairs!r}:
        try:
            check(path, expected_path)
            print("GOLDEN", json.dumps([path, "ok"]))
        except Exception:
            print("GOLDEN", json.dumps([path, traceback.format_exc()[-3000:]]))
"""


def _made_here(path: Path) -> bool:
    return torch_build().version.split("+")[0] == _parts(path)[2]


@pytest.fixture(scope="module")
def golden_runs() -> dict[str, str]:
    """Each pair made under the running release: "ok", or how it failed, from one fresh
    process."""
    pairs = [(str(p), str(p.with_suffix(".expected.pt"))) for p in PAIRS if _made_here(p)]
    proc = run_python(_RUN_GOLDEN.format(golden=str(GOLDEN), pairs=pairs), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [
        json.loads(line[len("GOLDEN ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("GOLDEN ")
    ]
    return dict(said)


@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.name)
def test_load_takes_the_pairs_inside_the_reading_window(path: Path, golden_runs) -> None:
    version, _, made_under = _parts(path)
    assert spec.OLDEST_READABLE_SCHEMA <= version <= spec.SCHEMA_VERSION, (
        "a golden pair outside the reading window belongs in the refusal test below"
    )
    if not _made_here(path):
        with pytest.raises(PrecompileError, match=f"was built with torch {made_under}"):
            precompile.load_file(path)
        return
    assert golden_runs.get(str(path)) == "ok", golden_runs.get(str(path), "not run")


@pytest.mark.parametrize(
    "path", [p for p in PAIRS if _version(p) == spec.OLDEST_READABLE_SCHEMA], ids=lambda p: p.name
)
def test_load_refuses_a_version_the_window_has_left(path: Path, monkeypatch) -> None:
    major = _version(path)[0]
    monkeypatch.setattr(versions, "OLDEST_READABLE_SCHEMA", (major + 1, 0))
    with pytest.raises(
        PrecompileError,
        match=(
            f"schema version {major}; this torch-precompile reads schema versions "
            f"{major + 1}.0 to .*Precompile it again with this version"
        ),
    ):
        precompile.load_file(path)


def test_load_refuses_a_newer_major_before_running_anything() -> None:
    newest = next(p for p in PAIRS if _parts(p)[:2] == (spec.SCHEMA_VERSION, "eager"))
    major = spec.SCHEMA_VERSION[0]
    code = newest.read_text().replace(
        f"'schema_version': {spec.SCHEMA_VERSION},", f"'schema_version': ({major + 1}, 0),", 1
    )
    code = code.replace("\nimport torch\n", "\nraise SystemExit('executed')\nimport torch\n", 1)
    with pytest.raises(
        PrecompileError, match=f"schema version {major + 1}.0; .*Upgrade torch-precompile"
    ):
        precompile.load(code, None)


def test_an_older_inductor_artifact_needing_builds_without_its_cache_is_refused() -> None:
    """Its source does not record the vector width its kernels were written for: building
    them for this CPU's width could corrupt memory, so without the cache to tell it, no."""
    code = (GOLDEN / "schema6-inductor.artifact").read_text()
    match = (
        "was built with torch 2.13.0"
        if torch_build().version.split("+")[0] != INTEGER_ERA
        else "does not record the vector width that source was generated for"
    )
    with pytest.raises(PrecompileError, match=match):
        precompile.load(code, None)
