"""``precompile.for_generate``: transformers causal LMs generating from an artifact, and KV
caches passed to fn as objects that hold tensors.

Each model's pair is built here once (eager backend; ``test_generate_inductor.py`` holds the
other), then a fresh process with no compiler loads them and generates as eager does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torch_precompile import PrecompileError, precompile

from conftest import poisoned_toolchain, run_python

transformers = pytest.importorskip("transformers")

import generate_models  # noqa: E402  (needs transformers)
from generate_models import BATCH_SIZES, CONFIGS, MAX_CACHE_LEN  # noqa: E402


def build_pairs(
    directory: Path, backend: str, batches: dict[str, tuple[int, ...]]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each model's pair built for its batch sizes: {name: (path, batch sizes)}."""
    pairs = {}
    for name, batch_sizes in batches.items():
        path = directory / f"{name}-{backend}.py"
        model = generate_models.make(name)
        precompile.for_generate(
            model, path, max_cache_len=MAX_CACHE_LEN, batch_sizes=batch_sizes, backend=backend
        )
        pairs[name] = (str(path), batch_sizes)
    return pairs


def fresh_generations(
    pairs: dict[str, tuple[str, tuple[int, ...]]], tmp_path: Path
) -> dict[str, object]:
    """Load each pair in a fresh process with no compiler and compare with eager."""
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(
        f"""
        import json, sys
        from torch_precompile import precompile
        import generate_models as g
        differ = []
        for name, (path, batch_sizes) in {pairs!r}.items():
            model = g.make(name)
            precompile.for_generate(model, path, max_cache_len=g.MAX_CACHE_LEN,
                                    batch_sizes=batch_sizes)
            differ += g.differences(name, model, batch_sizes)
        # (transformers itself imports Inductor when a model is made)
        built = [n for n in sys.modules if n.startswith(("torch_precompile.trace",
                 "torch_precompile.lower", "torch_precompile.internals.tracing"))]
        print(json.dumps({{"differ": differ, "build_modules": built}}))
        """,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["compiled"] = marker.exists()
    return result


@pytest.fixture(scope="module")
def eager_pairs(tmp_path_factory) -> dict[str, tuple[str, tuple[int, ...]]]:
    batches = dict.fromkeys(CONFIGS, BATCH_SIZES)
    return build_pairs(tmp_path_factory.mktemp("generate"), "eager", batches)


def test_every_model_generates_as_eager_in_a_fresh_process(eager_pairs, tmp_path) -> None:
    """Greedy and seeded sampling, batch 1 (prompts of 5 and 1 tokens) and batch 4 with left
    padding, 16 new tokens each: the same tokens as eager, from the saved pairs alone."""
    result = fresh_generations(eager_pairs, tmp_path)
    assert result == {"differ": [], "build_modules": [], "compiled": False}


@pytest.fixture
def llama(eager_pairs) -> torch.nn.Module:
    model = generate_models.make("llama")
    return precompile.for_generate(
        model, eager_pairs["llama"][0], max_cache_len=MAX_CACHE_LEN, batch_sizes=BATCH_SIZES
    )


def _ids(batch: int = 1, length: int = 5) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"output_attentions": True, "return_dict_in_generate": True}, "'output_attentions'"),
        ({"cache_implementation": "dynamic"}, "generate\\(\\) passed a DynamicCache"),
        ({"max_new_tokens": MAX_CACHE_LEN}, "more than the max_cache_len=24"),
    ],
    ids=["output_attentions", "dynamic_cache", "too_long"],
)
def test_generate_options_that_change_the_computation_are_refused(llama, options, message) -> None:
    with pytest.raises(PrecompileError, match=message):
        llama.generate(_ids(), **{"max_new_tokens": 3, **options})
    # Nothing stuck: the next plain call is served (generate() keeps no larger cache size).
    assert llama.generate(_ids(), max_new_tokens=3).shape == (1, 8)


def test_a_batch_not_built_for_is_refused(llama) -> None:
    with pytest.raises(
        PrecompileError, match=r"a batch of 2; this artifact serves batch sizes \(1, 4\)"
    ):
        llama.generate(_ids(batch=2), max_new_tokens=3)


def test_a_config_value_changed_after_capture_is_refused(llama) -> None:
    llama.config.rms_norm_eps = 0.5
    with pytest.raises(PrecompileError, match="'config.rms_norm_eps' of the model is 0.5"):
        llama.generate(_ids(), max_new_tokens=3)


def test_for_generate_refuses_what_it_cannot_serve(eager_pairs, tmp_path) -> None:
    with pytest.raises(PrecompileError, match="takes a transformers model with generate"):
        precompile.for_generate(torch.nn.Linear(2, 2), tmp_path / "x.py", max_cache_len=16)
    with pytest.raises(PrecompileError, match="must be an int above 5"):
        precompile.for_generate(generate_models.make("llama"), tmp_path / "x.py", max_cache_len=4)
    path = eager_pairs["llama"][0]
    model = precompile.for_generate(
        generate_models.make("llama"), path, max_cache_len=MAX_CACHE_LEN
    )
    with pytest.raises(PrecompileError, match="already runs a for_generate artifact"):
        precompile.for_generate(model, path, max_cache_len=MAX_CACHE_LEN)
    with pytest.raises(PrecompileError, match="keyword arguments only"):
        model(_ids())


# KV caches as fn's arguments.


def _step(model, ids, position, cache):
    return model(input_ids=ids, cache_position=position, past_key_values=cache).logits[:, -1]


def _static_cache(model, length: int = 16, batch: int = 1, ready: bool = True):
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    if ready:
        cache.early_initialization(batch, 2, 8, torch.float32, torch.device("cpu"))
    return cache


@pytest.fixture(scope="module")
def cache_step():
    model = generate_models.make("llama")
    ids, position = _ids(), torch.arange(5)
    with torch.no_grad():
        code, cache = precompile(_step, model, ids, position, _static_cache(model), backend="eager")
    return model, precompile.load(code, cache), code


def test_a_static_cache_is_written_in_place_as_in_eager(cache_step) -> None:
    model, run, code = cache_step
    ids, position = _ids(), torch.arange(5)
    mine, eager = _static_cache(model), _static_cache(model)
    with torch.no_grad():
        torch.testing.assert_close(
            run(model, ids, position, mine), _step(model, ids, position, eager)
        )
    for a, b in zip(mine.layers, eager.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert int(a.cumulative_length) == int(b.cumulative_length) == 5
    paths = [leaf.path for leaf in precompile.inspect(code).inputs]
    assert "cache.layers[1].keys" in paths and "cache.layers[0].max_cache_len" in paths


def test_a_cache_built_otherwise_is_refused_by_name(cache_step) -> None:
    model, run, _ = cache_step
    ids, position = _ids(), torch.arange(5)
    with torch.no_grad():
        with pytest.raises(
            PrecompileError,
            match=r"cache.layers\[0\].keys: expected shape \(1, 2, 16, 8\), got \(1, 2, 12, 8\)",
        ):
            run(model, ids, position, _static_cache(model, length=12))
        with pytest.raises(
            PrecompileError, match=r"input cache.layers holds 1 items; at capture it held 2"
        ):
            shorter = _static_cache(model)
            shorter.layers = shorter.layers[:1]
            run(model, ids, position, shorter)
        with pytest.raises(
            PrecompileError,
            match="input cache is a transformers.cache_utils.DynamicCache; at capture it was a "
            "transformers.cache_utils.StaticCache",
        ):
            run(model, ids, position, transformers.DynamicCache(config=model.config))
        with pytest.raises(
            PrecompileError,
            match=r"input cache.layers\[0\].batch_size: expected the value 1, got 4",
        ):
            run(model, ids, position, _static_cache(model, batch=4))


def test_caches_an_artifact_cannot_serve_are_refused_at_capture() -> None:
    model = generate_models.make("llama")
    ids, position = _ids(), torch.arange(5)
    with torch.no_grad():
        with pytest.raises(
            PrecompileError, match=r"fn sets cache.layers\[0\].keys .*cache.early_initialization"
        ):
            precompile(
                _step, model, ids, position, _static_cache(model, ready=False), backend="eager"
            )
        with pytest.raises(PrecompileError, match="holds no tensors yet"):
            precompile(
                _step,
                model,
                ids,
                position,
                transformers.DynamicCache(config=model.config),
                backend="eager",
            )
        grown = transformers.DynamicCache(config=model.config)
        _step(model, ids, position, grown)
        with pytest.raises(PrecompileError, match="A DynamicCache grows by making new tensors"):
            precompile(_step, model, _ids(length=1), torch.arange(5, 6), grown, backend="eager")
    windowed = generate_models.make("mistral")
    windowed.config.sliding_window = 8
    with (
        torch.no_grad(),
        pytest.raises(PrecompileError, match="keeps a Python count of its tokens"),
    ):
        precompile(_step, windowed, ids, position, _static_cache(windowed), backend="eager")


class _Counter:
    def __init__(self) -> None:
        self.total = torch.zeros(2)
        self.calls = 0


def _count(model, x, counter):
    counter.total.add_(model(x))
    counter.calls += 1
    return counter.total * 2


def test_any_object_holding_tensors_is_opened_and_its_python_writes_refused() -> None:
    model = torch.nn.Linear(3, 2)
    x = torch.randn(3)

    def add(model, x, counter):
        counter.total.add_(model(x))
        return counter.total * 2

    with torch.no_grad():
        with pytest.raises(
            PrecompileError, match=r"fn sets counter.calls \(an attribute of a .*_Counter\)"
        ):
            precompile(_count, model, x, _Counter(), backend="eager")
        run = precompile.load(*precompile(add, model, x, _Counter(), backend="eager"))
        mine, eager = _Counter(), _Counter()
        torch.testing.assert_close(run(model, x, mine), add(model, x, eager))
        assert torch.equal(mine.total, eager.total)
        other = _Counter()
        other.calls = 3
        with pytest.raises(
            PrecompileError, match="input counter.calls: expected the value 0, got 3"
        ):
            run(model, x, other)


def test_grouped_mm_experts_in_float32_are_refused_with_the_fix(tmp_path) -> None:
    model = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**{**generate_models.SMALL, "num_local_experts": 4})
    )
    with pytest.raises(PrecompileError, match="experts_implementation='batched_mm'"):
        precompile.for_generate(model, tmp_path / "moe.py", max_cache_len=16)
    assert not (tmp_path / "moe.py").exists()
