"""Real artifacts of every schema version: inspect reads each, load takes those it can read.

The pairs under tests/golden/ were made by earlier versions of this package (see its README)
and are never rewritten; a new schema version cannot land without its own pair.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torch_precompile import PrecompileError, precompile, spec
from torch_precompile.inspection import describe
from torch_precompile.internals import torch_build

from conftest import run_python

GOLDEN = Path(__file__).parent / "golden"
PAIRS = sorted(GOLDEN.glob("schema*-*.artifact"))
MADE_UNDER = "2.13.0"  # the torch release every golden pair was made with


def _version(path: Path) -> int:
    found = re.fullmatch(r"schema(\d+)-(eager|inductor)\.artifact", path.name)
    assert found, path
    return int(found[1])


def test_every_readable_version_has_a_golden_pair_per_backend() -> None:
    found = {path.name for path in PAIRS}
    for version in range(spec.OLDEST_READABLE_SCHEMA, spec.SCHEMA_VERSION + 1):
        for backend in ("eager", "inductor"):
            assert f"schema{version}-{backend}.artifact" in found, (
                f"schema version {version} has no golden {backend} pair: run "
                "`python tests/golden/make_golden.py` with the checkout that writes it"
            )


@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.name)
def test_inspect_reads_every_golden_pair(path: Path) -> None:
    code = path.read_text()
    read = precompile.inspect(code)
    assert read.schema_version == _version(path)
    assert read.backend in path.name
    assert [a.name for a in read.args] == ["model", "x", "target"]
    assert [t.name for t in read.parameters] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    report = describe(path)
    assert report["call"] == "forward(model, x, target)"
    assert report["source"]["schema_version"] == _version(path)


_RUN_GOLDEN = """
    import sys, torch
    sys.path.insert(0, {golden!r})
    from make_golden import golden_inputs, golden_model, train_step
    from torch_precompile import precompile
    run = precompile.load_file({path!r})
    model, eager_model = golden_model(), golden_model()
    # The second call accumulates onto .grad; from schema 7 the third runs the second variant.
    calls = [golden_inputs(), golden_inputs()]
    if run.spec.variants:
        from make_golden import wider_inputs
        calls.append(wider_inputs())
    for step, (x, target) in enumerate(calls):
        x = x + step
        loss = run(model, x, target)
        expected = train_step(eager_model, x, target)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    print("GOLDEN-OK")
"""


@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.name)
def test_load_takes_the_pairs_inside_the_reading_window(path: Path) -> None:
    version = _version(path)
    assert spec.OLDEST_READABLE_SCHEMA <= version <= spec.SCHEMA_VERSION, (
        "a golden pair outside the reading window belongs in the refusal test below"
    )
    if torch_build().version.split("+")[0] != MADE_UNDER:
        with pytest.raises(PrecompileError, match="was built with torch 2.13.0"):
            precompile.load_file(path)
        return
    proc = run_python(_RUN_GOLDEN.format(golden=str(GOLDEN), path=str(path)), timeout=600)
    assert proc.returncode == 0 and "GOLDEN-OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "path", [p for p in PAIRS if _version(p) == spec.OLDEST_READABLE_SCHEMA], ids=lambda p: p.name
)
def test_load_refuses_a_version_the_window_has_left(path: Path, monkeypatch) -> None:
    monkeypatch.setattr(spec, "OLDEST_READABLE_SCHEMA", _version(path) + 1)
    with pytest.raises(
        PrecompileError,
        match=(
            f"schema version {_version(path)}; this torch-precompile reads schema version "
            f"{_version(path) + 1}.*Precompile it again with this version"
        ),
    ):
        precompile.load_file(path)


def test_load_refuses_a_newer_version_before_running_anything(tmp_path: Path) -> None:
    newest = GOLDEN / f"schema{spec.SCHEMA_VERSION}-eager.artifact"
    code = newest.read_text().replace(
        f"'schema_version': {spec.SCHEMA_VERSION},",
        f"'schema_version': {spec.SCHEMA_VERSION + 1},",
        1,
    )
    code = code.replace("\nimport torch\n", "\nraise SystemExit('executed')\nimport torch\n", 1)
    with pytest.raises(
        PrecompileError,
        match=(f"schema version {spec.SCHEMA_VERSION + 1}; .*Upgrade torch-precompile"),
    ):
        precompile.load(code, None)


def test_an_older_inductor_artifact_needing_builds_without_its_cache_is_refused() -> None:
    """Its source does not record the vector width its kernels were written for: building
    them for this CPU's width could corrupt memory, so without the cache to tell it, no."""
    code = (GOLDEN / "schema6-inductor.artifact").read_text()
    match = (
        "was built with torch 2.13.0"
        if torch_build().version.split("+")[0] != MADE_UNDER
        else "does not record the vector width that source was generated for"
    )
    with pytest.raises(PrecompileError, match=match):
        precompile.load(code, None)
