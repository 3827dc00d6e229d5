"""A real model out of the box: a Hugging Face GPT-2 (tiny config, random weights)."""

from __future__ import annotations

import copy

import pytest
import torch

from torch_precompile import PrecompileError, precompile

from conftest import assert_same, model_state

transformers = pytest.importorskip("transformers")


def _gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=50,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def gpt2_train_step(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def gpt2_logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding exercises the mask-building code
    return ids, mask


@pytest.mark.parametrize("fn", [gpt2_train_step, gpt2_logits], ids=["train", "infer"])
def test_gpt2_matches_eager(fn, batch, backend: str) -> None:
    model = _gpt2().train(fn is gpt2_train_step)
    ids, mask = batch
    code, cache = precompile(fn, model, ids, mask, backend=backend)
    spec = precompile.inspect(code)
    assert {t.name: t.tied_to for t in spec.model if t.tied_to} == {
        "lm_head.weight": "transformer.wte.weight"
    }
    run = precompile.load(code, cache)
    other_ids = torch.randint(0, 50, ids.shape, generator=torch.Generator().manual_seed(2))
    # The example, then other weights and tokens (the same padding: the mask's path is guarded).
    for weights, tokens in ((model, ids), (_gpt2(seed=3).train(model.training), other_ids)):
        eager_model = copy.deepcopy(weights)
        for _ in range(2):
            assert_same(
                run(weights, tokens, mask), fn(eager_model, tokens, mask), rtol=1e-4, atol=1e-4
            )
        assert_same(model_state(weights), model_state(eager_model), rtol=1e-4, atol=1e-4)


def test_gpt2_mask_decision_is_guarded(batch, backend: str) -> None:
    """Captured with padding, the mask code took its general path; an all-ones mask would have
    taken the other one, and is refused instead of silently computed."""
    model = _gpt2().eval()
    ids, mask = batch
    code, cache = precompile(gpt2_logits, model, ids, mask, backend=backend)
    guards = [(g.description, g.expected) for g in precompile.inspect(code).value_guards]
    assert any("masking_utils.py" in description for description, _ in guards), guards
    run = precompile.load(code, cache)
    other_padding = torch.ones_like(mask)
    other_padding[0, :2] = 0
    assert_same(
        run(model, ids, other_padding), gpt2_logits(model, ids, other_padding), rtol=1e-4, atol=1e-4
    )
    with pytest.raises(PrecompileError, match="left the path"):
        run(model, ids, torch.ones_like(mask))
