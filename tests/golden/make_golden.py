"""Write this torch-precompile's golden artifact pairs into tests/golden/.

    python tests/golden/make_golden.py

Each pair is a small training step (an MLP, cross-entropy, backward) precompiled with both
backends and saved as ``schema<N>-<backend>.artifact`` (Python source; the suffix keeps
linters and test collection away from it) plus its cache. A new schema version adds its
pairs here and a row to tests/golden/README.md; the pairs of older versions stay as they were
made. The script uses only the public API, so the same file runs against older checkouts.

From schema 7 each pair holds two variants (``capture`` with two batch sizes), and inductor's
kernels are generated for 256-bit vectors, which every x86 machine with AVX2 can build. From
schema 10.0 every supported torch release has its own pair (run the script in each release's
environment). Beside each pair, ``<name>.expected.pt`` holds the weights and inputs it is
checked with and eager's results for them, so the test compares with stored values.
"""

import sys
from pathlib import Path

import torch

from torch_precompile import capture, precompile


def golden_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def golden_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, generator=generator), torch.tensor([0, 2])


def wider_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(3, 4, generator=generator), torch.tensor([1, 0, 2])


def train_step(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    return loss.detach()


def golden_calls(variants: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The calls a pair is checked with: the second accumulates onto .grad; with two variants
    the third runs the second one."""
    (x, target), wider = golden_inputs(), wider_inputs()
    calls = [(x, target), (x + 1, target)]
    return [*calls, (wider[0] + 2, wider[1])] if variants > 1 else calls


def expected_outputs(variants: int) -> dict[str, object]:
    """The inputs a pair is checked with and eager's results for them: the weights, each
    call's inputs and loss, and the gradients on .grad after the last call."""
    model = golden_model()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    calls = golden_calls(variants)
    losses = [train_step(model, x, target) for x, target in calls]
    grads = [p.grad.clone() for p in model.parameters()]
    return {"state": state, "calls": calls, "losses": losses, "grads": grads}


def pair_name(version: object, backend: str) -> str:
    """``schema<N>-<backend>`` for the versions written as one integer (made under torch
    2.13.0), ``schema<M.m>-<backend>-torch<release>`` after: one pair per torch release."""
    if isinstance(version, int):
        return f"schema{version}-{backend}"
    release = torch.__version__.split("+")[0]
    return f"schema{version[0]}.{version[1]}-{backend}-torch{release}"


def main(out: Path) -> None:
    from torch_precompile.spec import SCHEMA_VERSION

    for backend in ("eager", "inductor"):
        path = out / f"{pair_name(SCHEMA_VERSION, backend)}.artifact"
        if isinstance(SCHEMA_VERSION, int) and SCHEMA_VERSION < 7:
            code, cache = precompile(train_step, golden_model(), *golden_inputs(), backend=backend)
            precompile.save(code, cache, path)
        else:
            from torch._inductor import config

            with (
                config.patch({"cpp.simdlen": 256}),
                capture(train_step, artifact_path=path, backend=backend) as cap,
            ):
                cap(golden_model(), *golden_inputs())
                cap(golden_model(), *wider_inputs())
        print(path)
    write_expected(out)


def write_expected(out: Path) -> None:
    """Each pair's ``.expected.pt`` where it has none (the variant count from its name)."""
    for path in sorted(out.glob("schema*.artifact")):
        expected = path.with_suffix(".expected.pt")
        if not expected.exists():
            version = path.name.removeprefix("schema").split("-")[0]
            variants = 2 if float(version) >= 7 else 1
            torch.save(expected_outputs(variants), expected)
            print(expected)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
