"""Tensor subclasses carried by their flatten: a hand-written one (the mechanism is generic)
and torchao's quantized weights (int8 weight-only, int8 dynamic activations, int4, float8).

Each artifact is compared with the subclass model run eagerly, on new inputs and on a second
checkpoint (the same architecture quantized from other weights); every refusal is checked
with its message, at capture and at the call.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.decorators import mark_unbacked

from test_optimizers import step
from torch_precompile import PrecompileError, precompile
from torch_precompile.inspection import describe, render
from torch_precompile.spec import parse_spec

from conftest import run_python
from scaled_tensor import Blocks, Rounding, ScaledTensor, quantized_linear

# The inductor twin of each test here is kept: Inductor's lowering is part of what it checks.
pytestmark = pytest.mark.lowering


def run(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def scaled_model(seed: int, rows: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return quantized_linear(model.eval(), rows)


@functools.cache
def scaled_pair(backend: str) -> tuple[str, bytes]:
    return precompile(run, scaled_model(0), torch.randn(3, 8), backend=backend)


def assert_like_eager(
    forward: Callable[..., Any], model: torch.nn.Module, *inputs: Any, **tolerance: float
) -> None:
    with torch.no_grad():
        torch.testing.assert_close(forward(model, *inputs), model(*inputs), **tolerance)


# --- the mechanism, on a hand-written subclass -------------------------------------------


def test_a_subclass_model_runs_like_eager_with_new_inputs_and_weights(backend: str) -> None:
    forward = precompile.load(*scaled_pair(backend))
    for seed in (0, 1, 2):  # seed 0 is the captured model; the others are new checkpoints
        assert_like_eager(forward, scaled_model(seed), torch.randn(3, 8), rtol=0, atol=0)
    spec = parse_spec(scaled_pair(backend)[0])
    assert [(w.name, w.cls) for w in spec.wrapped] == [
        ("model parameter '0.weight'", "scaled_tensor.ScaledTensor"),
        ("model parameter '2.weight'", "scaled_tensor.ScaledTensor"),
    ]
    assert [(t.attr, t.dtype, t.shape) for t in spec.wrapped_inner[:2]] == [
        ("qdata", "torch.int8", (16, 8)),
        ("scale", "torch.float32", (16, 1)),
    ]


def test_inspect_names_each_subclass_its_inner_tensors_and_context(tmp_path: Path) -> None:
    path = precompile.save(*scaled_pair("eager"), tmp_path / "scaled.py")
    report = describe(path)
    assert report["subclasses"][0] == {
        "name": "model parameter '0.weight'",
        "class": "scaled_tensor.ScaledTensor",
        "shape": [16, 8],
        "inner": {"qdata": "(16, 8) int8", "scale": "(16, 1) float32"},
        "context": "{'blocks': scaled_tensor.Blocks(size=(1, 8), "
        "rounding=scaled_tensor.Rounding.NEAREST), 'dtype': torch.float32}",
    }
    assert (
        "subclass  : model parameter '0.weight' is a scaled_tensor.ScaledTensor: qdata "
        "(16, 8) int8, scale (16, 1) float32"
    ) in render(report)


def test_subclass_inputs_and_results_cross_the_boundary(backend: str) -> None:
    def doubled(x: ScaledTensor, y: torch.Tensor) -> tuple[ScaledTensor, torch.Tensor]:
        return ScaledTensor.quantize(x.dequantize() * 2), x.dequantize() + y

    x, y = ScaledTensor.quantize(torch.randn(4, 8)), torch.randn(4, 8)
    forward = precompile.load(*precompile(doubled, x, y, backend=backend))
    x2 = ScaledTensor.quantize(torch.randn(4, 8))
    result, total = forward(x2, y)
    expected, expected_total = doubled(x2, y)
    assert type(result) is ScaledTensor and result.blocks == Blocks((1, 8))
    torch.testing.assert_close(result.qdata, expected.qdata, rtol=0, atol=0)
    torch.testing.assert_close(result.scale, expected.scale)
    torch.testing.assert_close(total, expected_total)


def test_a_call_is_refused_for_another_context_inner_shape_class_or_a_plain_tensor() -> None:
    forward = precompile.load(*scaled_pair("inductor"))
    x = torch.randn(3, 8)
    with pytest.raises(
        PrecompileError,
        match=r"model parameter '0.weight': a scaled_tensor"
        r".ScaledTensor with 'blocks' = Blocks\(size=\(2, 8\).* in its flatten "
        r"context, where the captured one had Blocks\(size=\(1, 8\)",
    ):
        forward(scaled_model(0, rows=2), x)
    model = scaled_model(0)
    model[0].weight = torch.nn.Parameter(
        ScaledTensor(model[0].weight.qdata, model[0].weight.scale[:1], Blocks((1, 8))),
        requires_grad=False,
    )
    with pytest.raises(
        PrecompileError,
        match=r"'0.weight' \(its inner tensor 'scale'\): "
        r"expected shape \(16, 1\), dtype torch.float32, device cpu; got shape "
        r"\(1, 1\)",
    ):
        forward(model, x)
    with pytest.raises(
        PrecompileError,
        match=r"model parameter '0.weight': expected a "
        r"scaled_tensor.ScaledTensor .*got a plain tensor",
    ):
        forward(
            torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
            ).eval(),
            x,
        )
    plain = precompile.load(
        *precompile(run, scaled_model(0)[0].__class__(8, 16), x, backend="eager")
    )
    with pytest.raises(
        PrecompileError,
        match=r"model parameter 'weight' is a scaled_tensor"
        r".ScaledTensor, but was a plain tensor at capture",
    ):
        plain(scaled_model(0)[0], x)


def test_a_tensor_changed_after_a_call_that_passed_is_checked_again() -> None:
    """A call remembers tensors that passed; changing one's attributes or inner layout in
    place is caught all the same."""
    forward, model, x = precompile.load(*scaled_pair("eager")), scaled_model(3), torch.randn(3, 8)
    assert_like_eager(forward, model, x, rtol=0, atol=0)
    weight = model[0].weight
    weight.blocks = Blocks((1, 8), rounding=Rounding.DOWN)
    with pytest.raises(
        PrecompileError,
        match=r"'blocks' = Blocks\(size=\(1, 8\), rounding="
        r"<Rounding.DOWN",
    ):
        forward(model, x)
    weight.blocks = Blocks((1, 8))
    assert_like_eager(forward, model, x, rtol=0, atol=0)
    weight.scale.resize_(8, 2)
    with pytest.raises(
        PrecompileError,
        match=r"its inner tensor 'scale'\): expected shape "
        r"\(16, 1\).*got shape \(8, 2\)",
    ):
        forward(model, x)


def test_a_class_or_context_that_cannot_be_rebuilt_at_the_call_is_a_precompile_error() -> None:
    from torch_precompile.shipped.driver.subclasses import Wrapped, named

    with pytest.raises(
        PrecompileError,
        match=r"names no_such_package.Tensor, which cannot be "
        r"imported here; install the package",
    ):
        named("no_such_package.Tensor")
    record = parse_spec(scaled_pair("eager")[0]).wrapped[0]
    changed = dataclasses.replace(
        record,
        context=(
            "dataclass",
            (
                "scaled_tensor.Blocks",
                (("size", ("tuple", (("const", 1),))), ("columns", ("const", 8))),
            ),
        ),
    )
    with pytest.raises(
        PrecompileError,
        match=r"flatten context the artifact was captured with "
        r"cannot be rebuilt here \(TypeError: .*install the release",
    ):
        Wrapped(changed, []).resolve()


class _Tagged(torch.Tensor):
    """A subclass without __tensor_flatten__."""


@dataclasses.dataclass(eq=False)
class _ByIdentity:
    """Compares by identity, so a copy rebuilt from source is never equal to it."""

    rows: int = 1


def test_subclasses_the_artifact_cannot_rebuild_are_refused_at_capture() -> None:
    x = torch.randn(3, 8)
    tagged = torch.Tensor._make_subclass(_Tagged, torch.randn(4, 8))
    with pytest.raises(
        PrecompileError,
        match=r"input x is a test_subclasses._Tagged, a tensor "
        r"subclass without __tensor_flatten__",
    ):
        precompile(lambda x: x * 2, tagged)
    odd = ScaledTensor(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), object())
    with pytest.raises(
        PrecompileError,
        match=r"input x is a tensor subclass whose flatten "
        r"context holds a builtins.object, which the artifact cannot write as "
        r"source",
    ):
        precompile(lambda x: x * 2, odd)
    unequal = ScaledTensor(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), _ByIdentity())
    with pytest.raises(
        PrecompileError,
        match=r"input x is a scaled_tensor.ScaledTensor whose "
        r"flatten context does not come back equal when rebuilt from source",
    ):
        precompile(lambda x: x * 2, unequal)
    from torch.testing._internal.two_tensor import TwoTensor

    nested = ScaledTensor(
        torch.zeros(4, 8, dtype=torch.int8),
        TwoTensor(torch.ones(4, 1), torch.ones(4, 1)),
        Blocks((1, 8)),
    )
    with pytest.raises(
        PrecompileError,
        match=r"inner tensor 'scale' is itself a .*TwoTensor; "
        r"nested tensor subclasses are not carried",
    ):
        precompile(lambda x: x * 2, nested)
    trainable = scaled_model(0)
    trainable[0].weight.requires_grad_(True)
    with pytest.raises(
        PrecompileError,
        match=r"model parameter '0.weight' is a scaled_tensor"
        r".ScaledTensor with requires_grad=True; .*Freeze it",
    ):
        precompile(run, trainable, x)


def test_a_fresh_process_runs_the_pair_with_and_without_the_cache(tmp_path: Path) -> None:
    path = precompile.save(*scaled_pair("inductor"), tmp_path / "scaled.py")
    done = run_python(f"""
        import torch
        from torch_precompile import precompile
        from test_subclasses import scaled_model
        for forward in (precompile.load_file({str(path)!r}),
                        precompile.load(open({str(path)!r}).read(), None)):
            model, x = scaled_model(5), torch.randn(3, 8)
            with torch.no_grad():
                torch.testing.assert_close(forward(model, x), model(x), rtol=0, atol=0)
        print("same")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("same")


# --- torchao ------------------------------------------------------------------------------


def _torchao_configs() -> dict[str, Callable[[], Any]]:
    quantization = pytest.importorskip("torchao.quantization")
    int4 = pytest.importorskip("torchao.prototype.quantization.int4")
    return {
        "int8_weight_only": quantization.Int8WeightOnlyConfig,
        "int8_dynamic": quantization.Int8DynamicActivationInt8WeightConfig,
        "int4_weight_only": functools.partial(int4.PrototypeInt4WeightOnlyConfig, group_size=32),
        "float8_weight_only": quantization.Float8WeightOnlyConfig,
    }


CONFIGS = ["int8_weight_only", "int8_dynamic", "int4_weight_only", "float8_weight_only"]


def _dtype(config: str) -> torch.dtype:
    return torch.bfloat16 if config == "int4_weight_only" else torch.float32  # int4: CPU packing


def quantized(config: str, seed: int) -> torch.nn.Module:
    """An MLP quantized with ``config`` (int4's CPU kernel wants out features % 16 == 0)."""
    from torchao.quantization import quantize_

    torch.manual_seed(seed)
    model = (
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))
        .to(_dtype(config))
        .eval()
    )
    quantize_(model, _torchao_configs()[config]())
    return model


@functools.cache
def torchao_pair(config: str, backend: str) -> tuple[str, bytes]:
    return precompile(
        run, quantized(config, 0), torch.randn(2, 64, dtype=_dtype(config)), backend=backend
    )


@pytest.mark.parametrize("config", CONFIGS)
def test_torchao_model_runs_like_eager_with_a_second_checkpoint(config: str, backend: str) -> None:
    forward = precompile.load(*torchao_pair(config, backend))
    for seed in (0, 1):
        x = torch.randn(2, 64, dtype=_dtype(config))
        assert_like_eager(forward, quantized(config, seed), x, rtol=1e-5, atol=1e-5)


def test_a_torchao_call_is_refused_for_another_config_or_an_unquantized_model() -> None:
    forward = precompile.load(*torchao_pair("int8_weight_only", "eager"))
    x = torch.randn(2, 64)
    with pytest.raises(
        PrecompileError,
        match=r"model parameter '0.weight': a torchao.quantization"
        r".Int8Tensor with 'act_quant_kwargs' = QuantizeTensorToInt8Kwargs\(.* in "
        r"its flatten context, where the captured one had None",
    ):
        forward(quantized("int8_dynamic", 0), x)
    with pytest.raises(
        PrecompileError,
        match=r"model parameter '0.weight': expected a torchao"
        r".quantization.Int8Tensor .*got a plain tensor",
    ):
        forward(
            torch.nn.Sequential(
                torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)
            ).eval(),
            x,
        )
    with pytest.raises(
        PrecompileError,
        match=r"expected a torchao.quantization.Int8Tensor .*"
        r"got a torchao.quantization.Float8Tensor",
    ):
        forward(quantized("float8_weight_only", 0), x)


def test_a_quantized_body_with_a_trainable_head_trains_like_eager(backend: str) -> None:
    """int8 weight-only layers stay frozen; the plain head trains with AdamW inside fn."""

    def make(seed: int) -> torch.nn.Module:
        model = torch.nn.Sequential(
            quantized("int8_weight_only", seed), torch.nn.ReLU(), torch.nn.Linear(16, 5)
        )
        return model.train()

    def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model[2].parameters(), lr=1e-2)

    x, t = torch.randn(4, 64), torch.tensor([0, 1, 2, 3])
    example = make(0)
    forward = precompile.load(*precompile(step, example, optimizer(example), x, t, backend=backend))
    ours, eager = make(1), make(1)
    ours_opt, eager_opt = optimizer(ours), optimizer(eager)
    for seed in range(3):
        torch.manual_seed(seed)
        x, t = torch.randn(4, 64), torch.randint(0, 5, (4,))
        torch.testing.assert_close(
            forward(ours, ours_opt, x, t), step(eager, eager_opt, x, t), rtol=1e-5, atol=1e-6
        )
    for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
        if hasattr(p, "qdata"):  # a frozen quantized weight: untouched on both sides
            assert torch.equal(p.qdata, q.qdata) and torch.equal(p.scale, q.scale), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_quantized_model_serves_every_batch_size_with_a_dynamic_dim() -> None:
    x = torch.randn(4, 64)
    mark_unbacked(x, 0)
    forward = precompile.load(*precompile(run, quantized("int8_weight_only", 0), x))
    model = quantized("int8_weight_only", 2)
    for batch in (1, 7):
        assert_like_eager(forward, model, torch.randn(batch, 64), rtol=1e-5, atol=1e-5)
    # Dynamic activation quantization decides on whether the batch is 1: refused, with the
    # bound that settles it, which then serves every batch of 2 and more.
    x = torch.randn(4, 64)
    mark_unbacked(x, 0)
    with pytest.raises(
        PrecompileError,
        match=r"fn branches on.*declaring min=2.*stopped at: "
        r"Could not guard on data-dependent expression Ne\(u0, 1\)",
    ):
        precompile(run, quantized("int8_dynamic", 0), x)
    mark_unbacked(x, 0, min=2)
    forward = precompile.load(*precompile(run, quantized("int8_dynamic", 0), x))
    model = quantized("int8_dynamic", 2)
    for batch in (2, 7):
        assert_like_eager(forward, model, torch.randn(batch, 64), rtol=1e-5, atol=1e-5)


def test_a_fresh_process_serves_torchao_from_the_cache(tmp_path: Path) -> None:
    path = precompile.save(*torchao_pair("int8_dynamic", "inductor"), tmp_path / "int8.py")
    done = run_python(f"""
        import torch
        from torch_precompile import precompile
        from test_subclasses import quantized
        forward = precompile.load_file({str(path)!r})
        model, x = quantized("int8_dynamic", 3), torch.randn(2, 64)
        with torch.no_grad():
            torch.testing.assert_close(forward(model, x), model(x), rtol=1e-5, atol=1e-5)
        print("same")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("same")


def test_copies_of_the_model_are_unaffected(backend: str) -> None:
    """The call reads the caller's quantized tensors without changing them."""
    forward = precompile.load(*torchao_pair("int8_weight_only", backend))
    model = quantized("int8_weight_only", 4)
    before = copy.deepcopy(
        {
            k: (v.qdata.clone(), v.scale.clone())
            for k, v in model.state_dict().items()
            if hasattr(v, "qdata")
        }
    )
    forward(model, torch.randn(2, 64))
    for key, (qdata, scale) in before.items():
        assert torch.equal(model.state_dict()[key].qdata, qdata)
        assert torch.equal(model.state_dict()[key].scale, scale)


def tiny_llama(config: str, seed: int) -> torch.nn.Module:
    """A real architecture from transformers (random init, nothing downloaded), quantized."""
    transformers = pytest.importorskip("transformers")
    from torchao.quantization import quantize_

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).eval()
    quantize_(model, _torchao_configs()[config]())
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize(
    ("config", "backend"), [("int8_dynamic", "eager"), ("int8_weight_only", "inductor")]
)
def test_a_quantized_llama_runs_like_eager(config: str, backend: str) -> None:
    """(With Inductor, int8 dynamic activations round a few activations differently from
    eager, exactly as torch.compile does; weight-only agrees to float rounding.)"""
    ids = torch.randint(0, 128, (2, 16))
    forward = precompile.load(*precompile(logits, tiny_llama(config, 0), ids, backend=backend))
    model, ids = tiny_llama(config, 1), torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(forward(model, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
