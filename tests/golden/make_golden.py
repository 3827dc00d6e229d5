"""Write this torch-precompile's golden artifact pairs into tests/golden/.

    python tests/golden/make_golden.py

Each pair is a small training step (an MLP, cross-entropy, backward) precompiled with both
backends and saved as ``schema<N>-<backend>.artifact`` (Python source; the suffix keeps
linters and test collection away from it) plus its cache. A new schema version adds its
pairs here and a row to tests/golden/README.md; the pairs of older versions stay as they were
made. The script uses only the public API, so the same file runs against older checkouts.

From schema 7 each pair holds two variants (``capture`` with two batch sizes), and inductor's
kernels are generated for 256-bit vectors, which every x86 machine with AVX2 can build.
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


def main(out: Path) -> None:
    from torch_precompile.spec import SCHEMA_VERSION

    for backend in ("eager", "inductor"):
        path = out / f"schema{SCHEMA_VERSION}-{backend}.artifact"
        if SCHEMA_VERSION < 7:
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


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
