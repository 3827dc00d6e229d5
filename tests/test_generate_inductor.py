"""``precompile.for_generate`` on the inductor backend: one model of each kind in
``generate_models`` (Llama for the decoders built like it, Mixtral's experts) built with
Inductor, then generating as eager does in a fresh process with no compiler: greedy and
sampled, batch 4 with left padding, and for Llama batch 1 too. (On the default release only:
the lowering is torch's, the serving logic the eager file's, where every model runs. GPT-2's
lowering is test_gpt2.py's.)"""

from __future__ import annotations

import pytest

from generate_models import CONFIGS
from test_generate import build_pairs, fresh_generations

pytest.importorskip("transformers")


@pytest.mark.default_release
def test_every_model_generates_as_eager_from_inductor_pairs(tmp_path_factory, tmp_path) -> None:
    # Batch 1 and 4 for Llama, batch 4 (with padding) for the others: each batch size is
    # three more variants to compile (test_generate.py has every model at both on eager).
    # Qwen2, Mistral and Gemma lower as Llama does.
    kinds = ("llama", "mixtral")
    batches = {name: (1, 4) if name == "llama" else (4,) for name in CONFIGS if name in kinds}
    pairs = build_pairs(tmp_path_factory.mktemp("generate"), "inductor", batches)
    result = fresh_generations(pairs, tmp_path)
    assert result == {"differ": [], "build_modules": [], "compiled": False}
