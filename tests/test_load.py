"""load(): every row of the pairing table, and what it refuses to do."""

from __future__ import annotations

import io
import logging
import pickle

import pytest
import torch

from torch_precompile import PrecompileError, precompile
from torch_precompile.artifact import envelope

from conftest import assert_runs_like_eager

# The inductor twin of each test here is kept: Inductor's lowering is part of what it checks.
pytestmark = pytest.mark.lowering


def _envelope(**changes) -> bytes:
    payload = {
        "format": envelope.FORMAT,
        "version": envelope.VERSION,
        "backend": "eager",
        "code_hash": "0" * 64,
        "artifact": None,
        **changes,
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _check_runs(run) -> None:
    assert_runs_like_eager(run, "mlp_infer")


def test_code_that_does_not_parse(backend: str, artifacts) -> None:
    _, cache = artifacts.pair("mlp_infer", backend)
    with pytest.raises(PrecompileError, match="does not parse.*not a precompile artifact"):
        precompile.load("def broken(:\n", cache)
    with pytest.raises(PrecompileError, match="must be a str"):
        precompile.load(b"x = 1", cache)


def test_code_with_a_malformed_spec_is_refused_before_anything_runs(
    tmp_path, backend: str, artifacts
) -> None:
    code, cache = artifacts.pair("mlp_infer", backend)
    marker = tmp_path / "ran"
    hostile = f"open({str(marker)!r}, 'w').close()\n" + code.replace("'out_spec': ", "'out': ")
    with pytest.raises(
        PrecompileError,
        match=r"ArtifactSpec record with missing or unknown "
        r"fields \['out', 'out_spec'\]",
    ):
        precompile.load(hostile, cache)
    assert not marker.exists()


def test_spec_with_a_malformed_record_list_is_refused(backend: str, artifacts) -> None:
    from torch_precompile.spec import from_literal, spec_literal

    literal = spec_literal(artifacts.pair("mlp_infer", backend)[0])
    with pytest.raises(
        PrecompileError, match="holds int for 'model' where a list of ModelTensor records belongs"
    ):
        from_literal({**literal, "model": 5})
    with pytest.raises(PrecompileError, match="malformed Argument record"):
        from_literal({**literal, "args": [5]})


def test_spec_is_parsed_without_executing(tmp_path, backend: str, artifacts) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    marker = tmp_path / "ran"
    spec = precompile.inspect(f"open({str(marker)!r}, 'w').close()\n" + code)
    assert spec.backend == backend and [a.name for a in spec.args] == ["m", "x"]
    assert not marker.exists()


def test_backend_mismatch(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    other = "inductor" if backend == "eager" else "eager"
    forged = _envelope(backend=other, code_hash=envelope.code_hash(code))
    with pytest.raises(PrecompileError, match=f"made by backend '{other}'"):
        precompile.load(code, forged)


def test_cache_of_another_artifact_is_refused(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    _, other_cache = artifacts.pair("mlp_train", backend)
    with pytest.raises(PrecompileError, match="belongs to a different python_code"):
        precompile.load(code, other_cache)


@pytest.mark.parametrize(
    "cache",
    [b"", b"garbage", _envelope(format="someone-else"), _envelope(version=999)],
    ids=["empty", "garbage", "foreign-format", "future-version"],
)
def test_unusable_cache_warns_and_runs_from_code(
    cache: bytes, backend: str, artifacts, caplog
) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = precompile.load(code, cache)
    assert any("running from python_code alone" in r.message for r in caplog.records)
    _check_runs(run)


def test_truncated_cache_warns_and_runs(backend: str, artifacts, caplog) -> None:
    code, cache = artifacts.pair("mlp_infer", backend)
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = precompile.load(code, cache[: len(cache) // 2])
    assert any("unreadable" in r.message for r in caplog.records)
    _check_runs(run)


def test_no_cache(backend: str, artifacts) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    _check_runs(precompile.load(code, None))


def test_warns_once_per_source_before_executing(backend: str, artifacts, caplog) -> None:
    code, _ = artifacts.pair("mlp_infer", backend)
    hostile = "import logging\nlogging.getLogger('torch_precompile').warning('EXEC')\n" + code
    forged = envelope.pack(backend, hostile, None)
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        precompile.load(hostile, forged)
        precompile.load(hostile, forged)
    messages = [r.message for r in caplog.records]
    executing = [i for i, m in enumerate(messages) if "executing python_code" in m]
    assert len(executing) == 1  # said for the first load of this source only
    assert messages[executing[0] + 1] == "EXEC"
    assert messages.count("EXEC") == 2


def test_loaded_artifact_is_not_reexportable(backend: str, artifacts) -> None:
    run = artifacts.load("mlp_infer", backend)
    for attempt in (
        run.to_python_code,
        run.to_cache_bytes,
        lambda: run.python_code,
        lambda: pickle.dumps(run),
    ):
        with pytest.raises(PrecompileError, match="Keep the \\(python_code, cache\\) pair"):
            attempt()
    assert "forward(m, x)" in repr(run) and run.backend == backend
