"""Tiny causal LMs from transformers' configs (random weights, nothing downloaded), one per
architecture family that ``precompile.for_generate`` serves, and the generations compared."""

from __future__ import annotations

from typing import Any

import torch
import transformers

MAX_CACHE_LEN = 24
BATCH_SIZES = (1, 4)
NEW_TOKENS = 16

SMALL: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)
# Mixture-of-experts layers with batched_mm: every token meets every expert's weights in one
# batched matmul, where the default grouped_mm has no float32 shape function on CPU.
_MOE = dict(num_experts_per_tok=2, experts_implementation="batched_mm")

CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", SMALL),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SMALL),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**SMALL, "sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**SMALL, "head_dim": 8}),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=96,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**SMALL, **_MOE, "num_local_experts": 4, "sliding_window": None},
    ),
}


def make(name: str, seed: int = 0) -> torch.nn.Module:
    config_class, model_class, kwargs = CONFIGS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    return getattr(transformers, model_class)(config).eval()


def eager_reference(name: str) -> torch.nn.Module:
    """The same model generating in eager, with the static cache for_generate sets."""
    model = make(name)
    model.generation_config.cache_implementation = "static"
    model.generation_config.max_cache_len = MAX_CACHE_LEN
    return model


def prompts(
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, input ids, attention mask) at the batch sizes asked for: one row of 5 and of
    1 token, four rows of 7 with the second and third left-padded."""
    g = torch.Generator().manual_seed(7)
    made = []
    for batch, length in ((1, 5), (1, 1), (4, 7)):
        ids = torch.randint(3, 96, (batch, length), generator=g)
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[1, :3] = 0
            mask[2, :1] = 0
            ids[mask == 0] = 0
        if batch in batch_sizes:
            made.append((f"batch {batch}, prompt {length}", ids, mask))
    return made


def differences(
    name: str, model: torch.nn.Module, batch_sizes: tuple[int, ...] = BATCH_SIZES
) -> list[str]:
    """Where ``model`` (prepared with for_generate) generates other tokens than eager,
    greedy and sampling with a seed, over the same sequence of calls."""
    reference = eager_reference(name)
    found = []
    for label, ids, mask in prompts(batch_sizes):
        for sample in (False, True):
            outputs = []
            for each in (reference, model):
                torch.manual_seed(3)
                outputs.append(
                    each.generate(
                        ids,
                        attention_mask=mask,
                        max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS,
                        do_sample=sample,
                    )
                )
            if not torch.equal(*outputs):
                found.append(f"{name}: {label}, {'sampled' if sample else 'greedy'}")
    return found
