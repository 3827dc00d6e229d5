"""Builds without the weights: a model created on the meta device (or under a FakeTensorMode)
is precompiled for a named device, and the artifact runs with the real model there, in a fresh
process, as eager does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_precompile import PrecompileError, precompile
from torch_precompile.internals.tracing import FakeTensorMode

from conftest import poisoned_toolchain, run_python


class Net(torch.nn.Module):
    """Tied weights, a buffer that is a view of another, a literal made inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.b = torch.nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.register_buffer("table", torch.randn(3, 8))
        self.register_buffer("row", self.table[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.a(x)) * self.row + torch.tensor([0.5] * 8)
        return self.b(h.relu()) + self.table.sum(0)


def step(model: Net, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def forward(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def meta_net() -> tuple[Net, torch.Tensor]:
    with torch.device("meta"):
        return Net(), torch.empty(4, 8)


# In a fresh process: the real Net (seeded), each pair loaded with and without its cache,
# compared with eager over two steps (the training step), and forward then backward (the
# differentiable form).
FRESH = """
    import json, torch
    from torch_precompile import precompile
    from test_without_weights import Net, step, forward
    differ = []
    def same(what, a, b):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            differ.append(what)
    for use_cache in (True, False):
        torch.manual_seed(0)
        eager, model = Net(), Net()
        model.load_state_dict(eager.state_dict())
        run = precompile.load({step_code!r}, {step_cache!r} if use_cache else None)
        for i in range(2):
            x = torch.randn(4, 8)
            same(f"loss {{i}}", run(model, x), step(eager, x))
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                same(f"grad {{name}} {{i}}", p.grad, q.grad)
        run = precompile.load({forward_code!r}, {forward_cache!r} if use_cache else None)
        x = torch.randn(4, 8)
        for m in (model, eager):
            m.zero_grad()
        out = run(model, x)
        same("forward", out, forward(eager, x))
        out.sum().backward()
        forward(eager, x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            same(f"backward {{name}}", p.grad, q.grad)
    print(json.dumps(differ))
"""


def _save(tmp_path: Path, name: str, code: str, cache: bytes) -> dict[str, str]:
    (tmp_path / f"{name}.py").write_text(code)
    (tmp_path / f"{name}.cache").write_bytes(cache)
    return {
        f"{name}_code": str(tmp_path / f"{name}.py"),
        f"{name}_cache": str(tmp_path / f"{name}.cache"),
    }


def test_meta_model_builds_an_artifact_for_the_real_one(backend: str, tmp_path: Path) -> None:
    model, x = meta_net()
    paths = {
        **_save(tmp_path, "step", *precompile(step, model, x, backend=backend, device="cpu")),
        **_save(tmp_path, "forward", *precompile(forward, model, x, backend=backend, device="cpu")),
    }
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers())), "put back"
    assert model.row._base is model.table
    proc = run_python(FRESH.format(**paths))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_fake_tensor_model_builds_for_its_device(tmp_path: Path) -> None:
    with FakeTensorMode():
        model, x = Net(), torch.empty(4, 8)
    with torch.no_grad():
        code, cache = precompile(forward, model, x, backend="eager")
    run = precompile.load(code, cache)
    torch.manual_seed(1)
    real = Net()
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(run(real, x), real(x))


def test_llama_built_from_meta_equals_eager(backend: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    sizes = dict(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config = transformers.LlamaConfig(**sizes)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
        ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        code, cache = precompile(logits, model, ids, backend=backend, device="cpu", blocks=True)
    shared = "the forward of blocks model.layers.0, model.layers.1, run 2 times."
    assert f"# Piece 2 of 3: {shared}" in code
    paths = _save(tmp_path, "llama", code, cache)
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(
        f"""
        import torch, transformers
        from torch_precompile import precompile
        from test_without_weights import logits
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{sizes!r}))
        run = precompile.load({paths["llama_code"]!r}, {paths["llama_cache"]!r})
        with torch.no_grad():
            for n in (8, 8):
                ids = torch.randint(0, 128, (1, n))
                torch.testing.assert_close(run(model.eval(), ids), logits(model, ids))
        print("ok")
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok"]
    assert not marker.exists(), "a compiler was called although the cache holds every kernel"


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


def test_weights_larger_than_memory_are_never_allocated() -> None:
    """Four 16384 x 16384 float32 weights (4 GiB) build, adding far less than that to the peak."""
    proc = run_python(
        """
        import resource, torch
        from torch_precompile import precompile
        def peak_mib():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        before = peak_mib()
        with torch.device("meta"):
            model = torch.nn.Sequential(*(torch.nn.Linear(16384, 16384) for _ in range(4)))
            x = torch.empty(2, 16384)
        with torch.no_grad():
            precompile(lambda m, x: m(x), model, x, backend="eager", device="cpu")
        print(peak_mib() - before)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # MiB the build added to what importing torch took (that varies by build and machine);
    # the weights alone are 4096.
    assert int(proc.stdout.split()[-1]) < 1024


def _item(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model(x) * model.table.max().item()


class _Optimized:
    def __init__(self) -> None:
        self.model, self.x = meta_net()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no device", r"on the meta device.*device='cpu'"),
        ("meta device", r"device='meta' names no device"),
        ("device without stand-ins", r"no tensor of the arguments is on the meta device"),
        ("real input", r"argument 1 is a real tensor"),
        ("value read", r"fake tensors.*Reading tensor values.*real weights"),
        ("optimizer", r"takes no optimizer yet"),
        ("unknown device", r"device='nowhere' is not a device"),
    ],
)
def test_refusals_name_the_cause(case: str, message: str) -> None:
    model, x = meta_net()
    fn: Any = forward
    args: tuple[Any, ...] = (model, x)
    options: dict[str, Any] = {"backend": "eager", "device": "cpu"}
    if case == "no device":
        del options["device"]
    elif case == "meta device":
        options["device"] = "meta"
    elif case == "device without stand-ins":
        args = (Net(), torch.randn(4, 8))
    elif case == "real input":
        args = (model, torch.randn(4, 8))
    elif case == "value read":
        fn = _item
    elif case == "optimizer":
        made = _Optimized()
        fn, args = (lambda m, x, opt: step(m, x)), (made.model, made.x, made.opt)
    elif case == "unknown device":
        options["device"] = "nowhere"
    with pytest.raises(PrecompileError, match=message):
        precompile(fn, *args, **options)
    assert all(t.is_meta for t in model.parameters())


def test_the_meta_model_runs_once_its_weights_are_loaded() -> None:
    """The usual recipe: build from the meta model, then materialize that same model and load
    its weights (to_empty, load_state_dict) and call the artifact with it."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        x = torch.empty(2, 8)
    with torch.no_grad():
        code, cache = precompile(forward, model, x, backend="eager", device="cpu")
    torch.manual_seed(4)
    trained = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model.to_empty(device="cpu").load_state_dict(trained.state_dict())
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(precompile.load(code, cache)(model, x), trained(x))
