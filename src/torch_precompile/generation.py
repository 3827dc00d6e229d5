"""``precompile.for_generate``: a transformers causal LM whose ``forward`` runs an artifact
inside ``model.generate(...)``, prefill and decode steps alike, with a static KV cache.

The artifact is built from the calls generate() itself makes (recorded on a short generation
of a dummy prompt, one per batch size asked for), so it takes exactly their arguments: per
batch size, a decode step (one token, static shapes) and a prefill (the prompt length a
dynamic dim). The cache is a ``StaticCache`` of ``max_cache_len`` tokens, whose layers the
forward initializes before the artifact runs (they otherwise create their tensors on first
use, which an artifact cannot replay).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree
from torch_precompile.internals.generation import (
    experts_implementation,
    mark_dynamic_dim,
    remember_cache_size,
)
from torch_precompile.options import BuildOptions
from torch_precompile.shipped.driver.values import holds_tensors

# How long a prompt the build's dummy generation uses: prefill then needs no size-1 dim.
_DUMMY_PROMPT = 3


def generate_step(model: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
    """The captured computation: one forward as generate() calls it, its result without the
    cache object (which the caller holds; the forward writes its tensors in place)."""
    out = type(model).forward(model, **kwargs)
    return type(out)(**{k: v for k, v in out.items() if not holds_tensors(v)})


@dataclass(frozen=True)
class GenerateSettings:
    """What a ``for_generate`` artifact serves."""

    max_cache_len: int
    batch_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (isinstance(self.max_cache_len, int) and self.max_cache_len > _DUMMY_PROMPT + 2):
            raise PrecompileError(
                "max_cache_len (the most tokens one generate() call holds, prompt and new "
                f"ones) must be an int above {_DUMMY_PROMPT + 2}, got {self.max_cache_len!r}."
            )
        if not self.batch_sizes or not all(isinstance(b, int) and b > 0 for b in self.batch_sizes):
            raise PrecompileError(f"batch_sizes must be positive ints, got {self.batch_sizes!r}.")


@dataclass
class GenerateForward:
    """What ``model.forward`` becomes: it initializes the cache generate() passes, runs the
    artifact, and puts the cache back into the result where generate() looks for it."""

    model: Any  # a transformers PreTrainedModel
    settings: GenerateSettings
    artifact: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        # generate() chooses what to pass (position ids, say) by the forward's signature.
        self.__signature__ = _class_forward_signature(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise PrecompileError(
                "a model prepared with precompile.for_generate serves generate(), which calls "
                f"forward with keyword arguments only; this call passed {len(args)} positional "
                "ones. Pass them by name, as generate() does."
            )
        held = [(k, v) for k, v in kwargs.items() if _is_cache(v)]
        for _, cache in held:
            self._refuse_unserved(cache, kwargs)
            initialize_cache(cache, self.model, kwargs)
        if self.artifact is None:
            raise PrecompileError("internal: a for_generate forward called before its load")
        try:
            result = self.artifact(self.model, kwargs)
        except PrecompileError as e:
            raise PrecompileError(
                "this call of generate() does not fit the for_generate artifact (generate() "
                "options that change the computation, such as output_attentions, are not "
                f"served): {e}"
            ) from None
        fields = getattr(type(result), "__dataclass_fields__", {})
        back = {k: v for k, v in held if k in fields}
        return type(result)(**result, **back) if back else result

    def _refuse_unserved(self, cache: Any, kwargs: dict[str, Any]) -> None:
        """Refuse, before anything runs, a cache longer or a batch other than the artifact
        serves, in generate()'s terms."""
        settings, layers = self.settings, getattr(cache, "layers", [])
        length = getattr(layers[0], "max_cache_len", None) if layers else None
        if type(cache).__name__ != "StaticCache" or length is None:
            raise PrecompileError(
                f"generate() passed a {type(cache).__name__}; a for_generate artifact serves "
                "the static cache it set on model.generation_config. Leave "
                "cache_implementation and past_key_values out of generate()."
            )
        if length > settings.max_cache_len:
            # generate() sizes later caches to the largest it made; back to the one served.
            remember_cache_size(self.model, settings.max_cache_len)
            raise PrecompileError(
                f"generate() made a KV cache of {length} tokens (the prompt plus "
                f"max_new_tokens), more than the max_cache_len={settings.max_cache_len} this "
                "artifact serves. Ask for fewer tokens, or build for a larger max_cache_len "
                "(at another path)."
            )
        ids = kwargs.get("input_ids")
        batch = ids.shape[0] if isinstance(ids, torch.Tensor) else None
        if batch not in settings.batch_sizes:
            raise PrecompileError(
                f"generate() runs a batch of {batch}; this artifact serves batch sizes "
                f"{settings.batch_sizes}. Build with batch_sizes including it (at another "
                "path)."
            )


def _class_forward_signature(model: torch.nn.Module) -> inspect.Signature:
    return inspect.signature(type(model).forward.__get__(model))


def _is_cache(value: Any) -> bool:
    return type(value).__module__.startswith("transformers.cache_utils")


def initialize_cache(cache: Any, model: Any, kwargs: dict[str, Any]) -> None:
    """Create the tensors of a static cache's layers, as its first update would."""
    layers = getattr(cache, "layers", [])
    if not layers or all(getattr(layer, "is_initialized", True) for layer in layers):
        return
    if not hasattr(cache, "early_initialization"):
        return  # the artifact refuses it by name
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise PrecompileError(
            "precompile.for_generate serves generate() on input_ids; this call passes none "
            "(inputs_embeds?), so the cache's batch size is unknown."
        )
    dtype = next(model.parameters()).dtype
    cache.early_initialization(ids.shape[0], heads, head_dim, dtype, ids.device)


def for_generate(
    model: Any,
    path: str | os.PathLike[str],
    settings: GenerateSettings,
    options: BuildOptions,
) -> Any:
    """Point ``model.forward`` at the artifact saved at ``path``, building and saving it first
    when there is none; set generate() to a static cache of ``settings.max_cache_len``."""
    from torch_precompile import runtime, storage

    _refuse_non_causal_lm(model)
    _set_generation_config(model, settings.max_cache_len)
    # Set before the capture, which records the forward the model runs (checked at calls).
    forward = GenerateForward(model, settings)
    model.forward = forward
    try:
        if not Path(path).exists():
            code, cache = build_generate_pair(model, settings, options)
            storage.save(code, cache, path, sign_key=options.sign_key)
        saved = storage.read_saved(path)
        # A pair signed at its build is verified with the same key at every load.
        forward.artifact = runtime.load(
            saved.code, saved.cache, verify_key=options.sign_key, cache_absence=saved.absence
        )
    except BaseException:
        del model.forward
        raise
    return model


def _refuse_non_causal_lm(model: Any) -> None:
    if not (isinstance(model, torch.nn.Module) and callable(getattr(model, "generate", None))):
        raise PrecompileError(
            "precompile.for_generate takes a transformers model with generate() (a causal "
            f"LM built from its config or from_pretrained), got {type(model).__name__}."
        )
    experts = experts_implementation(model.config)
    if experts == "grouped_mm" and next(model.parameters()).dtype != torch.bfloat16:
        raise PrecompileError(
            "this model's mixture-of-experts layers run transformers' grouped_mm experts, "
            "whose shape function takes bfloat16 only, so they cannot be traced in "
            f"{next(model.parameters()).dtype}. Load the model with "
            "experts_implementation='batched_mm' (every expert as one batched matmul), or in "
            "bfloat16."
        )
    if isinstance(model.forward, GenerateForward):
        raise PrecompileError(
            "this model's forward already runs a for_generate artifact; call for_generate on "
            "a model once."
        )


def _set_generation_config(model: Any, max_cache_len: int) -> None:
    config = model.generation_config
    config.cache_implementation = "static"
    config.max_cache_len = max_cache_len
    # generate() would otherwise torch.compile the forward on GPUs (auto-compile).
    config.disable_compile = True


def build_generate_pair(
    model: torch.nn.Module, settings: GenerateSettings, options: BuildOptions
) -> tuple[str, bytes | None]:
    """Capture the forward calls generate() makes, a prefill and a decode step per batch size,
    as the variants of one artifact."""
    from torch_precompile.build import compile_variant, package
    from torch_precompile.internals.origin import describe_callable

    origin = describe_callable(type(model).forward)
    options = dataclasses.replace(options, grad_mode=False)  # generate() runs under no_grad
    variants = []
    with torch.no_grad():
        for batch in settings.batch_sizes:
            decode, full = _recorded_calls(model, batch, padded=False)
            _, padded = _recorded_calls(model, batch, padded=True)
            calls = [decode, full] + ([padded] if _form(padded) != _form(full) else [])
            for call in calls[1:]:
                _mark_prompt_dims(call, settings.max_cache_len)
            variants += [
                compile_variant(generate_step, (model, call), options, origin=origin)
                for call in calls
            ]
    return package(variants, options)


def _form(call: dict[str, Any]) -> Any:
    """A call's structure: which arguments it passes, and which of them are None."""
    leaves, structure = pytree.tree_flatten(call)
    return structure, [leaf is None for leaf in leaves]


def _mark_prompt_dims(call: dict[str, Any], max_cache_len: int) -> None:
    """Mark the prompt's length dynamic in a prefill call: the last dim of the token ids
    (and positions), the query dim of a 4-d attention mask."""
    dims = [(call.get(name), -1) for name in ("input_ids", "position_ids", "cache_position")]
    mask = call.get("attention_mask")
    # One mask, or one per kind of attention layer ({"full_attention": ...}).
    for each in mask.values() if isinstance(mask, dict) else [mask]:
        dims.append((each, 2 if isinstance(each, torch.Tensor) and each.dim() == 4 else -1))
    for tensor, dim in dims:
        if isinstance(tensor, torch.Tensor):
            # A prompt leaves room in the cache for at least one new token.
            top = max_cache_len - 1
            mark_dynamic_dim(tensor, dim % tensor.dim(), "tokens", 2, top)


def _recorded_calls(model: Any, batch: int, padded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of generate()'s decode step and prefill on a dummy prompt of
    ``batch`` rows (its first row left-padded where ``padded``: generate() then passes an
    attention mask it leaves out otherwise), each copied as the call received it."""
    calls: list[dict[str, Any]] = []
    with _recording(model, calls):
        ids = torch.full((batch, _DUMMY_PROMPT), 1, dtype=torch.long, device=model.device)
        mask = torch.ones_like(ids)
        if padded:
            mask[0, 0] = 0
        # min_new_tokens: an end-of-text token drawn by the random weights ends no row early.
        model.generate(
            ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False
        )
    if len(calls) < 2:
        raise PrecompileError(
            f"generate() made {len(calls)} forward calls for two new tokens, where a prefill "
            "and a decode step were expected; this model's generate() is not served."
        )
    return calls[1], calls[0]


@contextlib.contextmanager
def _recording(model: Any, calls: list[dict[str, Any]]) -> Iterator[None]:
    forward = type(model).forward

    def recorded(*args: Any, **kwargs: Any) -> Any:
        for value in kwargs.values():
            if _is_cache(value):
                initialize_cache(value, model, kwargs)
        calls.append(copy.deepcopy(kwargs))
        return forward(model, *args, **kwargs)

    own = model.__dict__.get("forward")
    recorded.__signature__ = _class_forward_signature(model)  # type: ignore[attr-defined]
    model.forward = recorded
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
