"""Model zoo: real architectures, each precompiled, saved, reloaded and compared with eager.

    python benchmarks/zoo.py                                  # every case, mode and backend
    python benchmarks/zoo.py --cases gpt2,bert --backends eager --modes infer
    python benchmarks/zoo.py --list                           # the cases and what they cover

Every model is built from a config with random weights (transformers config classes, timm
``create_model(..., pretrained=False)``, torchvision ``weights=None``, torch.nn modules); nothing
is downloaded. Models are tiny (hidden sizes 16-64, 1-2 layers, 32x32 or 64x64 images, batch 2,
sequences of 8) so that an Inductor build takes seconds to a few minutes on two cores.

Each (case, mode, backend) runs in a fresh child process (this script with ``--child``), with its
own empty Inductor cache and temp dir. The child builds the model from a seed and deep-copies it
for eager, calls ``precompile``, writes the pair with ``precompile.save``, loads it back with
``precompile.load_file`` and compares with eager on the same weights:

- ``infer``: the model in ``eval()``; outputs on new inputs (not the example), then again on other
  new inputs after both copies load a second checkpoint (other random weights and BatchNorm
  statistics) with ``load_state_dict``.
- ``train``: the model in ``train()``; the step runs the forward, a loss, ``loss.backward()`` and
  returns the loss; three SGD steps (lr 0.1) on new inputs, comparing each step's loss and
  gradients, then the final parameters and buffers.
- ``train_adamw``: the same step with ``AdamW.step()`` and ``zero_grad()`` inside fn, the
  optimizer passed as an argument (lr 1e-3, eps 1e-3: with the default eps an update is nearly
  the sign of its gradient, which float32 rounding flips where a gradient is near zero); three
  steps from a fresh optimizer, comparing each step's loss, parameters, buffers and optimizer
  state (``exp_avg``, the square root of ``exp_avg_sq``, ``step``). Where numbers differ, the
  run is still ok when eager float32 differs from float64 at least as much at every such place
  (ours is then within eager's own float32 error), or, as in ``train``, when each step started
  from eager's weights and optimizer state agrees (to within eager's own float32 error) and
  eager float32 drifts from float64 too (the two trajectories merely diverge); its message
  says so.

Both modes also check that capturing left the model untouched (parameters, buffers, ``.grad``).
Tolerances are rtol 1e-3, atol 1e-4 unless a case says otherwise (with the reason).

Status: ok; refused (``PrecompileError`` at capture, its message recorded); wrong (numbers or
structure differ: the first place and its max abs diff, and how many places differ); error (any
other exception, or a ``PrecompileError`` after capture: the phase, type and first line);
crash (the child died or ran past ``--timeout``).

When numbers differ, the child looks closer before it says wrong. It runs the same procedure
with eager float32 against eager float64, and says how far they are apart at the first place
that differs. In training it also reruns the steps with the artifact's model set to eager's
values at the start of each step: when every such step agrees and eager float32 drifts from
float64 over the steps too, the two trajectories merely diverge as any two float32 runs of that
case would (a high learning rate on a small batch), and the run is ok with a message saying so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import datetime
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "ZOO.md"
MODES = ("infer", "train", "train_adamw")
ADAMW = {"lr": 1e-3, "eps": 1e-3}
BACKENDS = ("eager", "inductor")
BLOCKS = {"auto": None, "on": True, "off": False}  # --blocks: precompile's blocks=
STATUSES = ("ok", "refused", "wrong", "error", "crash")
CHILD_TIMEOUT_S = 600
RTOL, ATOL = 1e-3, 1e-4
LR = 0.1
TRAIN_STEPS = 3
BATCH, SEQ, VOCAB, IMAGE = 2, 8, 64, 32

# Seeds: weights of the model and of the second checkpoint; inputs of the example, of the
# inference checks and of each training step. Every input set is drawn fresh from its seed.
MODEL_SEED, CHECKPOINT_SEED = 0, 1
EXAMPLE_SEED, INFER_SEEDS, TRAIN_SEED = 100, (101, 102), 110


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def token_ids(g: torch.Generator, length: int = SEQ, low: int = 1) -> torch.Tensor:
    return torch.randint(low, VOCAB, (BATCH, length), generator=g)


def padding_mask(g: torch.Generator, *, left: bool, length: int = SEQ) -> torch.Tensor:
    """Row 0 unpadded, row 1 padded by 1-3 tokens: every draw takes the same path through the
    mask code (some padding), with other values."""
    mask = torch.ones(BATCH, length, dtype=torch.long)
    pad = int(torch.randint(1, 4, (1,), generator=g))
    if left:
        mask[1, :pad] = 0
    else:
        mask[1, length - pad :] = 0
    return mask


def images(g: torch.Generator, size: int = IMAGE, channels: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size, generator=g)


def labels(g: torch.Generator, classes: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, classes, (BATCH, *shape), generator=g)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def float_leaves(out: Any) -> list[torch.Tensor]:
    return [
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


def mean_square(out: Any) -> torch.Tensor:
    """The default training loss: the mean square of every floating output, added up (in
    float32 at least)."""
    return sum(
        (t if t.dtype == torch.float64 else t.float()).pow(2).mean() for t in float_leaves(out)
    )


@dataclass(frozen=True)
class Case:
    name: str
    library: str
    what: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple[Any, ...]]
    forward: Callable[..., Any]
    # The training loss from (model, *inputs); default: mean_square(forward(model, *inputs)).
    loss: Callable[..., torch.Tensor] | None = None
    modes: tuple[str, ...] = MODES
    rtol: float = RTOL
    atol: float = ATOL

    def train_loss(self, model: nn.Module, *inputs: Any) -> torch.Tensor:
        if self.loss is not None:
            return self.loss(model, *inputs)
        return mean_square(self.forward(model, *inputs))


CASES: dict[str, Case] = {}


def case(name: str, library: str, what: str, **kwargs: Any) -> Callable[[Callable], Callable]:
    """Register the decorated builder as a case."""

    def register(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        CASES[name] = Case(name, library, what, build, **kwargs)
        return build

    return register


# transformers ------------------------------------------------------------------------------


def lm_inputs_left(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return token_ids(g), padding_mask(g, left=True)


def lm_logits(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, attention_mask=mask).logits


def lm_loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, attention_mask=mask, labels=ids).loss


@case(
    "gpt2",
    "transformers",
    "GPT-2 LM head, use_cache=False, left padding, tied embeddings; train: LM loss",
    inputs=lm_inputs_left,
    forward=lm_logits,
    loss=lm_loss,
)
def gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=VOCAB,
        n_positions=32,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )


@case(
    "llama",
    "transformers",
    "Llama causal LM, use_cache=True (default: a DynamicCache is built inside), GQA, RoPE, "
    "left padding; train: LM loss",
    inputs=lm_inputs_left,
    forward=lm_logits,
    loss=lm_loss,
)
def llama() -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(llama_config())


def llama_decode_inputs(g: torch.Generator) -> tuple[Any, ...]:
    """One decode step after a prompt of SEQ tokens: the new token, the past keys and values of
    each layer (as a plain list of tensors), the mask over past and new tokens."""
    config = llama_config()
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    past = [
        (
            torch.randn(BATCH, heads, SEQ, dim, generator=g),
            torch.randn(BATCH, heads, SEQ, dim, generator=g),
        )
        for _ in range(config.num_hidden_layers)
    ]
    return token_ids(g, 1), past, padding_mask(g, left=True, length=SEQ + 1)


def llama_decode(m: nn.Module, ids: torch.Tensor, past: list, mask: torch.Tensor) -> Any:
    from transformers import DynamicCache

    out = m(input_ids=ids, attention_mask=mask, cache=DynamicCache(past))
    return out.logits, [(layer.keys, layer.values) for layer in out.cache.layers]


@case(
    "llama_decode",
    "transformers",
    "Llama decode step: past keys/values in, a DynamicCache built from them, logits and the "
    "updated keys/values out",
    inputs=llama_decode_inputs,
    forward=llama_decode,
    modes=("infer",),
)
def llama_kv() -> nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(llama_config())


def bert_inputs(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    mask = padding_mask(g, left=False)
    ids = token_ids(g) * mask
    token_types = torch.zeros_like(ids)
    token_types[:, SEQ // 2 :] = 1
    return ids, mask, token_types, labels(g, 3)


def bert_logits(m: nn.Module, ids: Any, mask: Any, token_types: Any, target: Any) -> Any:
    return m(input_ids=ids, attention_mask=mask, token_type_ids=token_types).logits


def bert_loss(m: nn.Module, ids: Any, mask: Any, token_types: Any, target: Any) -> Any:
    return m(input_ids=ids, attention_mask=mask, token_type_ids=token_types, labels=target).loss


@case(
    "bert",
    "transformers",
    "BERT sequence classifier, attention mask with right padding, token types; "
    "train: cross-entropy",
    inputs=bert_inputs,
    forward=bert_logits,
    loss=bert_loss,
)
def bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def seq2seq_inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return token_ids(g), token_ids(g, SEQ // 2)


def seq2seq_logits(m: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=target).logits


def seq2seq_loss(m: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=target).loss


@case(
    "t5",
    "transformers",
    "T5 encoder-decoder, relative position bias, decoder inputs shifted from labels; "
    "train: LM loss",
    inputs=seq2seq_inputs,
    forward=seq2seq_logits,
    loss=seq2seq_loss,
)
def t5() -> nn.Module:
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def image_inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return images(g), labels(g, 10)


def hf_image_logits(m: nn.Module, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return m(pixel_values=pixels).logits


def hf_image_loss(m: nn.Module, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return m(pixel_values=pixels, labels=target).loss


@case(
    "vit",
    "transformers",
    "ViT image classifier, 32x32, patch 8; train: cross-entropy",
    inputs=image_inputs,
    forward=hf_image_logits,
    loss=hf_image_loss,
)
def vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=IMAGE,
        patch_size=8,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config)


WHISPER_MELS, WHISPER_FRAMES = 16, 32


def whisper_inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(BATCH, WHISPER_MELS, WHISPER_FRAMES, generator=g), token_ids(g, SEQ // 2))


def whisper_logits(m: nn.Module, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return m(input_features=features, labels=target).logits


def whisper_loss(m: nn.Module, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return m(input_features=features, labels=target).loss


@case(
    "whisper",
    "transformers",
    "Whisper speech encoder-decoder (conv front end on log-mel features, use_cache default); "
    "train: LM loss",
    inputs=whisper_inputs,
    forward=whisper_logits,
    loss=whisper_loss,
)
def whisper() -> nn.Module:
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=WHISPER_MELS,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=WHISPER_FRAMES // 2,
        max_target_positions=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


def wav2vec2_inputs(g: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, 400, generator=g),)


def wav2vec2_logits(m: nn.Module, audio: torch.Tensor) -> torch.Tensor:
    return m(input_values=audio).logits


@case(
    "wav2vec2",
    "transformers",
    "Wav2Vec2 CTC head on raw audio: conv feature encoder with GroupNorm, weight-normed "
    "positional conv; train: mean square of logits",
    inputs=wav2vec2_inputs,
    forward=wav2vec2_logits,
)
def wav2vec2() -> nn.Module:
    import transformers

    # mask_time_prob and layerdrop draw random decisions in train mode: off, to compare.
    config = transformers.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,
        layerdrop=0.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
    )
    return transformers.Wav2Vec2ForCTC(config)


CLIP_EOS = VOCAB - 1


def clip_inputs(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Text tokens 3..62, an end-of-text token (63) last before the padding: the text tower
    pools at it."""
    mask = padding_mask(g, left=False)
    ids = torch.randint(3, CLIP_EOS, (BATCH, SEQ), generator=g)
    ids[torch.arange(BATCH), mask.sum(1) - 1] = CLIP_EOS
    return ids * mask, mask, images(g)


def clip_logits(m: nn.Module, ids: Any, mask: Any, pixels: Any) -> Any:
    out = m(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    return out.logits_per_image, out.text_embeds, out.image_embeds


def clip_loss(m: nn.Module, ids: Any, mask: Any, pixels: Any) -> Any:
    return m(input_ids=ids, attention_mask=mask, pixel_values=pixels, return_loss=True).loss


@case(
    "clip",
    "transformers",
    "CLIP text and vision towers, padded text pooled at its end-of-text token; "
    "train: its contrastive loss",
    inputs=clip_inputs,
    forward=clip_logits,
    loss=clip_loss,
)
def clip() -> nn.Module:
    import transformers

    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=CLIP_EOS,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=8,
        ),
        projection_dim=16,
    )
    return transformers.CLIPModel(config)


# timm --------------------------------------------------------------------------------------


def classifier_logits(m: nn.Module, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return m(pixels)


def classifier_loss(m: nn.Module, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(pixels), target)


CLASSIFIER = dict(inputs=image_inputs, forward=classifier_logits, loss=classifier_loss)


def large_image_inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return images(g, 2 * IMAGE), labels(g, 10)


# Networks that downsample 32x: at 32x32 their last BatchNorms normalize 2 values per channel
# (batch 2, 1x1), and training gradients are so ill-conditioned that eager float32 and float64
# disagree by far more than the tolerance. At 64x64 (2x2) they agree.
CLASSIFIER_64 = dict(CLASSIFIER, inputs=large_image_inputs)


def timm_model(name: str, **kwargs: Any) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)


@case(
    "timm_resnet18",
    "timm",
    "resnet18 (BatchNorm, max pool), 64x64; train: cross-entropy",
    **CLASSIFIER_64,
)
def timm_resnet18() -> nn.Module:
    return timm_model("resnet18")


@case(
    "timm_mobilenetv3",
    "timm",
    "mobilenetv3_small_050 (depthwise convs, squeeze-excite, hard-swish), 64x64; "
    "train: cross-entropy",
    **CLASSIFIER_64,
)
def timm_mobilenetv3() -> nn.Module:
    return timm_model("mobilenetv3_small_050")


@case(
    "timm_vit",
    "timm",
    "vit_tiny_patch16_224 shrunk: 32x32, patch 8, width 64, depth 2 (fused SDPA); "
    "train: cross-entropy",
    **CLASSIFIER,
)
def timm_vit() -> nn.Module:
    return timm_model(
        "vit_tiny_patch16_224", img_size=IMAGE, patch_size=8, embed_dim=64, depth=2, num_heads=2
    )


@case(
    "timm_convnext",
    "timm",
    "convnext_atto shrunk: depths 1-1-1-1, widths 16-64 (depthwise 7x7, LayerNorm2d, layer "
    "scale), 32x32; train: cross-entropy",
    **CLASSIFIER,
)
def timm_convnext() -> nn.Module:
    return timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 48, 64))


# torchvision -------------------------------------------------------------------------------


@case("tv_resnet18", "torchvision", "resnet18, 64x64; train: cross-entropy", **CLASSIFIER_64)
def tv_resnet18() -> nn.Module:
    from torchvision import models

    return models.resnet18(weights=None, num_classes=10)


@case(
    "tv_mobilenet_v3_small",
    "torchvision",
    "mobilenet_v3_small, 64x64, classifier dropout 0; train: cross-entropy",
    **CLASSIFIER_64,
)
def tv_mobilenet_v3_small() -> nn.Module:
    from torchvision import models

    return models.mobilenet_v3_small(weights=None, num_classes=10, dropout=0.0)


SEG_SIZE, SEG_CLASSES = 64, 4


def segmentation_inputs(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return images(g, SEG_SIZE), labels(g, SEG_CLASSES, SEG_SIZE, SEG_SIZE)


def segmentation_out(m: nn.Module, pixels: torch.Tensor, target: torch.Tensor) -> Any:
    return m(pixels)  # a dict: {"out": logits}


def segmentation_loss(m: nn.Module, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(pixels)["out"], target)


@case(
    "tv_lraspp",
    "torchvision",
    "segmentation: lraspp_mobilenet_v3_large (dilated backbone, bilinear upsampling, dict "
    "output), 64x64; train: per-pixel cross-entropy",
    inputs=segmentation_inputs,
    forward=segmentation_out,
    loss=segmentation_loss,
)
def tv_lraspp() -> nn.Module:
    from torchvision.models import segmentation

    return segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=SEG_CLASSES
    )


# torch.nn built-ins ------------------------------------------------------------------------


def call(m: nn.Module, *inputs: Any) -> Any:
    return m(*inputs)


class RNNHead(nn.Module):
    """A recurrent layer and a linear head on its outputs; returns the head's output and the
    final states."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 4)

    def forward(self, x: torch.Tensor, *state: Any) -> Any:
        out, final = self.rnn(x, *state)
        return self.head(out), final


def sequence(g: torch.Generator, *, batch_first: bool = True) -> torch.Tensor:
    shape = (BATCH, SEQ, 16) if batch_first else (SEQ, BATCH, 16)
    return torch.randn(*shape, generator=g)


@case(
    "nn_lstm",
    "torch.nn",
    "LSTM, 2 layers, batch-first, zero initial state",
    inputs=lambda g: (sequence(g),),
    forward=call,
)
def nn_lstm() -> nn.Module:
    return RNNHead(nn.LSTM(16, 32, num_layers=2, batch_first=True))


@case(
    "nn_lstm_bi",
    "torch.nn",
    "LSTM, 2 layers, bidirectional, sequence-first, given (h0, c0)",
    inputs=lambda g: (
        sequence(g, batch_first=False),
        (torch.randn(4, BATCH, 32, generator=g), torch.randn(4, BATCH, 32, generator=g)),
    ),
    forward=call,
)
def nn_lstm_bi() -> nn.Module:
    return RNNHead(nn.LSTM(16, 32, num_layers=2, bidirectional=True))


@case(
    "nn_gru",
    "torch.nn",
    "GRU, 2 layers, batch-first, given h0",
    inputs=lambda g: (sequence(g), torch.randn(2, BATCH, 32, generator=g)),
    forward=call,
)
def nn_gru() -> nn.Module:
    return RNNHead(nn.GRU(16, 32, num_layers=2, batch_first=True))


def key_padding(g: torch.Generator) -> torch.Tensor:
    """True where a key is padding (row 1 padded at the end), as nn attention modules take it."""
    return padding_mask(g, left=False) == 0


def encoder_forward(m: nn.Module, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return m(x, src_key_padding_mask=pad)


def transformer_forward(m: nn.Module, src: Any, tgt: Any, pad: Any) -> torch.Tensor:
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
    return m(
        src,
        tgt,
        tgt_mask=causal,
        src_key_padding_mask=pad,
        memory_key_padding_mask=pad,
        tgt_is_causal=True,
    )


# Both outputs are layer-normed, so their mean square is about 1 whatever the weights: the
# training loss is the mean square of a few features instead.
@case(
    "nn_transformer_encoder",
    "torch.nn",
    "TransformerEncoder, 2 post-norm layers, src_key_padding_mask",
    inputs=lambda g: (torch.randn(BATCH, SEQ, 32, generator=g), key_padding(g)),
    forward=encoder_forward,
    loss=lambda m, *inputs: encoder_forward(m, *inputs)[..., :4].pow(2).mean(),
)
def nn_transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2)


@case(
    "nn_transformer",
    "torch.nn",
    "nn.Transformer encoder-decoder, 1+1 pre-norm layers, causal target mask, key padding",
    inputs=lambda g: (
        torch.randn(BATCH, SEQ, 32, generator=g),
        torch.randn(BATCH, SEQ // 2, 32, generator=g),
        key_padding(g),
    ),
    forward=transformer_forward,
    loss=lambda m, *inputs: transformer_forward(m, *inputs)[..., :4].pow(2).mean(),
)
def nn_transformer() -> nn.Module:
    return nn.Transformer(
        d_model=32,
        nhead=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=64,
        dropout=0.0,
        batch_first=True,
        norm_first=True,
    )


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 32, mode="mean")
        self.weighted = nn.EmbeddingBag(VOCAB, 32, mode="sum")
        self.head = nn.Linear(64, 4)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> Any:
        mean = self.bag(ids, offsets)
        weighted = self.weighted(ids, offsets, per_sample_weights=weights)
        return self.head(torch.cat([mean, weighted], dim=1))


def bag_inputs(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, VOCAB, (2 * SEQ,), generator=g)
    split = int(torch.randint(1, 2 * SEQ, (1,), generator=g))
    return ids, torch.tensor([0, split]), torch.rand(2 * SEQ, generator=g)


@case(
    "nn_embeddingbag",
    "torch.nn",
    "EmbeddingBag mean and weighted sum over 2 bags of varying offsets, linear head",
    inputs=bag_inputs,
    forward=call,
)
def nn_embeddingbag() -> nn.Module:
    return BagClassifier()


@case(
    "nn_cnn",
    "torch.nn",
    "Conv2d + BatchNorm2d + ReLU + MaxPool2d twice, global average pool, linear; "
    "train: cross-entropy (running stats update)",
    **CLASSIFIER,
)
def nn_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


class SDPABlock(nn.Module):
    """Causal self-attention, then attention with a boolean mask over the keys, both through
    F.scaled_dot_product_attention."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def attend(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs
        )
        return self.out(y.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(x, is_causal=True)
        return x + self.attend(x, attn_mask=keep[:, None, None, :])


@case(
    "nn_sdpa",
    "torch.nn",
    "scaled_dot_product_attention: causal, then with a boolean key mask",
    inputs=lambda g: (torch.randn(BATCH, SEQ, 32, generator=g), ~key_padding(g)),
    forward=call,
)
def nn_sdpa() -> nn.Module:
    return SDPABlock()


@case(
    "nn_mha",
    "torch.nn",
    "MultiheadAttention, batch-first, key_padding_mask, averaged attention weights returned",
    inputs=lambda g: (torch.randn(BATCH, SEQ, 32, generator=g), key_padding(g)),
    forward=lambda m, x, pad: m(x, x, x, key_padding_mask=pad),
)
def nn_mha() -> nn.Module:
    return nn.MultiheadAttention(32, 4, batch_first=True)


# --------------------------------------------------------------------------------------------
# The child: one (case, mode, backend)
# --------------------------------------------------------------------------------------------


Found = list[tuple[str, float, str]]


def seeded_model(c: Case, seed: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return c.build()


def seeded_inputs(c: Case, seed: int, dtype: torch.dtype | None = None) -> tuple[Any, ...]:
    inputs = c.inputs(torch.Generator().manual_seed(seed))
    if dtype is None:
        return inputs
    return pytree.tree_map(
        lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
        inputs,
    )


def second_checkpoint(c: Case) -> dict[str, torch.Tensor]:
    """Other random weights; BatchNorm running statistics drawn too, so buffers change."""
    state = seeded_model(c, CHECKPOINT_SEED).state_dict()
    g = torch.Generator().manual_seed(CHECKPOINT_SEED)
    for name, value in state.items():
        if name.endswith("running_mean"):
            state[name] = 0.1 * torch.randn(value.shape, generator=g)
        elif name.endswith("running_var"):
            state[name] = 0.5 + torch.rand(value.shape, generator=g)
    return state


def model_state(model: nn.Module, *, grads: bool = True) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, p in model.named_parameters():
        state[f"param {name}"] = p.detach()
        if grads:
            state[f"grad {name}"] = None if p.grad is None else p.grad.detach()
    for name, b in model.named_buffers():
        state[f"buffer {name}"] = b.detach()
    return state


@dataclass
class Compare:
    """Where ``found`` collects differences, at the case's tolerance. ``widen`` compares tensors
    of different floating dtypes in float64 (the float32 against float64 check)."""

    c: Case
    found: Found
    widen: bool = False

    def __call__(self, where: str, actual: Any, expected: Any) -> None:
        differences(where, actual, expected, self.c.rtol, self.c.atol, self.found, widen=self.widen)

    def state(
        self, where: str, model: nn.Module, expected: nn.Module, *, grads: bool = True
    ) -> None:
        """Parameters, buffers and (with ``grads``) gradients of two models, name by name."""
        actual, wanted = model_state(model, grads=grads), model_state(expected, grads=grads)
        if actual.keys() != wanted.keys():
            self.found.append((where, float("inf"), "the models' tensor names differ"))
            return
        for name in wanted:
            self(f"{where}{name}", actual[name], wanted[name])


def differences(
    where: str,
    actual: Any,
    expected: Any,
    rtol: float,
    atol: float,
    found: Found,
    *,
    widen: bool = False,
) -> None:
    """Append (where, max abs diff, detail) for every place ``actual`` and ``expected`` differ."""
    a_leaves, a_spec = pytree.tree_flatten_with_path(actual)
    e_leaves, e_spec = pytree.tree_flatten_with_path(expected)
    if a_spec != e_spec:
        found.append((where, float("inf"), f"structure differs: {a_spec} vs {e_spec}"))
        return
    for (path, a), (_, e) in zip(a_leaves, e_leaves, strict=True):
        at = f"{where}{pytree.keystr(path)}"
        if not isinstance(e, torch.Tensor) or not isinstance(a, torch.Tensor):
            if type(a) is not type(e) or a != e:
                found.append((at, float("inf"), f"{short(a)} vs {short(e)}"))
            continue
        same_dtype = a.dtype == e.dtype or (
            widen and a.is_floating_point() and e.is_floating_point()
        )
        if a.shape != e.shape or not same_dtype:
            found.append(
                (at, float("inf"), f"{a.dtype}{list(a.shape)} vs {e.dtype}{list(e.shape)}")
            )
            continue
        if a.numel() == 0:
            continue
        a64, e64 = a.detach().double(), e.detach().double()
        close = torch.isclose(a64, e64, rtol=rtol, atol=atol, equal_nan=True)
        if bool(close.all()):
            continue
        diff = (a64 - e64).abs().nan_to_num(nan=float("inf"))
        excess = (diff - (atol + rtol * e64.abs())).masked_fill(close, -float("inf"))
        index = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        found.append(
            (
                at,
                float(diff.max()),
                f"{int((~close).sum())}/{a.numel()} elements; at {list(index)}: "
                f"{a64[index].item():.6g} vs {e64[index].item():.6g}",
            )
        )


def short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compare_infer(
    c: Case,
    model: nn.Module,
    call: Callable[..., Any],
    reference: nn.Module,
    check: Compare,
    result: dict[str, Any],
    *,
    reference_dtype: torch.dtype | None = None,
) -> None:
    """``call(model, ...)`` against ``c.forward(reference, ...)``: on new inputs, then on other
    new inputs after both load a second checkpoint; then the models' state."""
    for i, seed in enumerate(INFER_SEEDS):
        if i == 1:
            result["phase"] = "load_state_dict"
            state = second_checkpoint(c)
            model.load_state_dict(state)
            reference.load_state_dict(state)
        label = "new inputs" if i == 0 else "second checkpoint"
        result["phase"] = f"call ({label})"
        out = call(model, *seeded_inputs(c, seed))
        result["phase"] = f"eager reference ({label})"
        expected = c.forward(reference, *seeded_inputs(c, seed, reference_dtype))
        check(f"infer, {label}: out", out, expected)
    check.state("infer, end: ", model, reference)


def training_step(c: Case) -> Callable[..., torch.Tensor]:
    def step(m: nn.Module, *inputs: Any) -> torch.Tensor:
        loss = c.train_loss(m, *inputs)
        loss.backward()
        return loss.detach()

    return step


def compare_train(
    c: Case,
    model: nn.Module,
    call: Callable[..., Any],
    reference: nn.Module,
    check: Compare,
    result: dict[str, Any],
    *,
    reference_dtype: torch.dtype | None = None,
    resync: bool = False,
) -> None:
    """TRAIN_STEPS SGD steps of ``call`` on ``model`` and of the eager step on ``reference``,
    each on new inputs: every step's loss and gradients, then the parameters and buffers.
    With ``resync``, each step starts with ``model`` set to ``reference``'s values: every step
    from the same state, rather than two trajectories."""
    step = training_step(c)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for i in range(TRAIN_STEPS):
        if resync:
            with torch.no_grad():
                for mine, theirs in zip(
                    model.state_dict().values(), reference.state_dict().values(), strict=True
                ):
                    mine.copy_(theirs)
        result["phase"] = f"call (step {i + 1})"
        opt.zero_grad()
        loss = call(model, *seeded_inputs(c, TRAIN_SEED + i))
        result["phase"] = f"eager reference (step {i + 1})"
        reference_opt.zero_grad()
        expected = step(reference, *seeded_inputs(c, TRAIN_SEED + i, reference_dtype))
        check(f"step {i + 1}: loss", loss, expected)
        check.state(f"step {i + 1}: ", model, reference)
        opt.step()
        reference_opt.step()
    check.state("after training: ", model, reference, grads=False)


def adamw_step(c: Case) -> Callable[..., torch.Tensor]:
    def step(m: nn.Module, opt: torch.optim.Optimizer, *inputs: Any) -> torch.Tensor:
        loss = c.train_loss(m, *inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def optimizer_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """AdamW's state per parameter name, with exp_avg_sq as its square root (gradient units)."""
    state = {}
    for name, p in model.named_parameters():
        entries = opt.state.get(p, {})
        state[name] = {k: v.sqrt() if k == "exp_avg_sq" else v for k, v in entries.items()}
    return state


def compare_train_adamw(
    c: Case,
    model: nn.Module,
    call: Callable[..., Any],
    reference: nn.Module,
    check: Compare,
    result: dict[str, Any],
    *,
    reference_dtype: torch.dtype | None = None,
    resync: bool = False,
) -> None:
    """TRAIN_STEPS calls of ``call(model, opt, ...)`` and of the eager AdamW step on
    ``reference``, each from a fresh AdamW: losses, parameters, buffers, optimizer state.
    With ``resync``, each step starts from ``reference``'s weights and optimizer state."""
    step = adamw_step(c)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    reference_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for i in range(TRAIN_STEPS):
        if resync:
            model.load_state_dict(reference.state_dict())
            opt.load_state_dict(copy.deepcopy(reference_opt.state_dict()))
        result["phase"] = f"call (step {i + 1})"
        loss = call(model, opt, *seeded_inputs(c, TRAIN_SEED + i))
        result["phase"] = f"eager reference (step {i + 1})"
        expected = step(
            reference, reference_opt, *seeded_inputs(c, TRAIN_SEED + i, reference_dtype)
        )
        check(f"step {i + 1}: loss", loss, expected)
        check.state(f"step {i + 1}: ", model, reference, grads=False)
        check(
            f"step {i + 1}: optimizer state",
            optimizer_state(opt, model),
            optimizer_state(reference_opt, reference),
        )


@dataclass(frozen=True)
class Procedure:
    """How a mode builds fn and its example arguments, and compares the artifact with eager."""

    training: bool
    fn: Callable[[Case], Callable[..., Any]]
    compare: Callable[..., None]
    with_optimizer: bool = False


PROCEDURES = {
    "infer": Procedure(False, lambda c: c.forward, compare_infer),
    "train": Procedure(True, training_step, compare_train),
    "train_adamw": Procedure(True, adamw_step, compare_train_adamw, with_optimizer=True),
}


def run_case(
    c: Case, mode: str, backend: str, path: Path, result: dict[str, Any], found: Found
) -> Callable[..., Any]:
    from torch_precompile import precompile

    procedure = PROCEDURES[mode]
    model = seeded_model(c, MODEL_SEED).train(procedure.training)
    eager = copy.deepcopy(model)
    check = Compare(c, found)
    passed = (
        (model, torch.optim.AdamW(model.parameters(), **ADAMW))
        if (procedure.with_optimizer)
        else (model,)
    )
    capture(result, procedure.fn(c), passed, seeded_inputs(c, EXAMPLE_SEED), backend, path)
    check.state("after capture: ", model, eager)
    result["phase"] = "load"
    run = load_timed(result, path, precompile)
    procedure.compare(c, model, run, eager, check, result)
    return run


def describe(found: Found) -> str:
    where, diff, detail = found[0]
    worst = max(d for _, d, _ in found)
    return (
        f"{where}: max abs diff {diff:.3g} ({detail}); {len(found)} place(s) differ, "
        f"worst {worst:.3g}"
    )


def float64_drift(c: Case, mode: str) -> Found:
    """Where eager float32 and eager float64 differ by the same procedure, at the case's
    tolerance: places where the case itself is too ill-conditioned to compare."""
    procedure = PROCEDURES[mode]
    model = seeded_model(c, MODEL_SEED).train(procedure.training)
    wide = copy.deepcopy(model).double()
    found: Found = []
    procedure.compare(
        c,
        model,
        procedure.fn(c),
        wide,
        Compare(c, found, widen=True),
        {},
        reference_dtype=torch.float64,
    )
    return found


def judge(c: Case, mode: str, run: Callable[..., Any], found: Found) -> tuple[str, str]:
    """Status and message for a run whose numbers differ from eager's.

    A training run is ok when each step, started from eager's state, agrees with eager's step
    and eager float32 itself drifts from float64 over the steps: the two trajectories diverge
    as any two float32 computations of the case would. Otherwise it is wrong; the message says
    how far eager float32 is from float64 at the first place that differs.
    """
    message = describe(found)
    where = found[0][0]
    if where.startswith("after capture"):
        return "wrong", message + " (capturing changed the model)"
    drift = float64_drift(c, mode)
    there = [d for w, d, _ in drift if w == where]
    note = (
        f"eager float32 vs float64 there: {there[0]:.3g}"
        if there
        else "eager float32 vs float64 agree there"
    )
    if mode == "train":
        model = seeded_model(c, MODEL_SEED).train()
        synced: Found = []
        compare_train(c, model, run, copy.deepcopy(model), Compare(c, synced), {}, resync=True)
        if synced:
            return "wrong", f"{describe(synced)}; also from eager's state at each step; {note}"
        if drift:
            return "ok", (
                f"trajectories drift ({message}); each step from eager's state "
                f"agrees; eager float32 vs float64 drift too ({describe(drift)})"
            )
        return "wrong", (
            f"{message}; each step from eager's state agrees, yet eager float32 "
            f"vs float64 do not drift"
        )
    drifts = {w: d for w, d, _ in drift}
    if mode == "train_adamw" and all(drifts.get(w, 0.0) >= d for w, d, _ in found):
        return "ok", (
            f"within eager's float32 error ({message}; eager float32 vs float64 "
            f"differ at least as much at each of those places)"
        )
    if mode == "train_adamw":
        model = seeded_model(c, MODEL_SEED).train()
        synced = []
        compare_train_adamw(
            c, model, run, copy.deepcopy(model), Compare(c, synced), {}, resync=True
        )
        if synced and all(drifts.get(w, 0.0) >= d for w, d, _ in synced):
            return "ok", (
                f"trajectories drift ({message}); each step from eager's weights and "
                f"optimizer state agrees within eager's float32 error "
                f"({describe(synced)}; eager float32 vs float64 differ at least as "
                "much there)"
            )
        if synced:
            return "wrong", f"{describe(synced)}; also from eager's state at each step; {note}"
        if drift:
            return "ok", (
                f"trajectories drift ({message}); each step from eager's weights "
                "and optimizer state agrees; eager float32 vs float64 drift too "
                f"({describe(drift)})"
            )
        return "wrong", (
            f"{message}; each step from eager's state agrees, yet eager float32 "
            "vs float64 do not drift"
        )
    return "wrong", f"{message}; {note}"


def capture(
    result: dict[str, Any],
    fn: Callable[..., Any],
    passed: tuple[Any, ...],
    example: tuple[Any, ...],
    backend: str,
    path: Path,
) -> None:
    """Precompile ``fn(*passed, *example)`` (``passed``: the model, and an optimizer)."""
    from torch_precompile import precompile
    from torch_precompile.inspection import describe

    result["phase"] = "capture"
    start = time.perf_counter()
    tracer = os.environ.get("ZOO_TRACER", "make_fx")  # the parent's --tracer
    blocks = BLOCKS[os.environ.get("ZOO_BLOCKS", "auto")]  # the parent's --blocks
    code, cache = precompile(fn, *passed, *example, backend=backend, tracer=tracer, blocks=blocks)
    result["build_s"] = time.perf_counter() - start
    result["phase"] = "save"
    precompile.save(code, cache, path)
    # The pieces of code alike blocks share, as `inspect` lists them.
    result["shared_pieces"] = len(describe(path)["blocks"])
    result["source_kib"] = path.stat().st_size / 1024
    caches = list(path.parent.glob(f"{path.stem}.*.cache"))
    result["cache_kib"] = sum(p.stat().st_size for p in caches) / 1024


def load_timed(result: dict[str, Any], path: Path, precompile: Any) -> Callable[..., Any]:
    for handler in logging.getLogger("torch_precompile").handlers:
        if isinstance(handler, LoadWarnings):
            handler.active = True
    start = time.perf_counter()
    run = precompile.load_file(path)
    result["load_s"] = time.perf_counter() - start
    return run


class LoadWarnings(logging.Handler):
    """Keeps the package's warnings after capture (a cache it could not use, kernels built from
    source at load), less the one every load gives (that it executes the source)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.active = False

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.active and "is executing python_code" not in message:
            self.messages.append(" ".join(message.split()))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def child(name: str, mode: str, backend: str, workdir: Path, result_path: Path) -> None:
    from torch_precompile import PrecompileError

    c = CASES[name]
    result: dict[str, Any] = {"status": None, "phase": "build model"}
    found: Found = []
    warned = LoadWarnings()
    logging.getLogger("torch_precompile").addHandler(warned)
    result["warnings"] = warned.messages
    try:
        run = run_case(c, mode, backend, workdir / f"{name}_{mode}_{backend}.py", result, found)
    except PrecompileError as exc:
        if result["phase"] == "capture":
            result["status"] = "refused"
            result["message"] = " ".join(str(exc).split())
        else:
            result["status"] = "error"
            result["message"] = f"{result['phase']}: {first_line(exc)}"
        result["traceback"] = traceback.format_exc()
    except Exception as exc:
        result["status"] = "error"
        result["message"] = f"{result['phase']}: {first_line(exc)}"
        result["traceback"] = traceback.format_exc()
    else:
        if found:
            result["differences"] = [list(f) for f in found]
            try:
                result["status"], result["message"] = judge(c, mode, run, found)
            except Exception as exc:
                result["status"] = "wrong"
                result["message"] = f"{describe(found)}; judging it failed: {first_line(exc)}"
                result["traceback"] = traceback.format_exc()
        else:
            result["status"] = "ok"
    if result["status"] == "ok" and warned.messages:
        warnings = "warned: " + "; ".join(dict.fromkeys(warned.messages))
        result["message"] = "; ".join(filter(None, [result.get("message"), warnings]))
    result_path.write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------
# The parent: run the children, print a line each, write the table
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    case: str
    mode: str
    backend: str
    status: str = ""
    message: str = ""
    build_s: float | None = None
    load_s: float | None = None
    source_kib: float | None = None
    cache_kib: float | None = None
    wall_s: float = 0.0


LIVE: set[subprocess.Popen] = set()  # children running now, ended if the parent is interrupted


def run_child(run: Run, timeout: float, threads: int | None, keep: Path | None) -> Run:
    workdir = Path(tempfile.mkdtemp(prefix=f"zoo-{run.case}-{run.mode}-{run.backend}-"))
    env = dict(os.environ)
    for var in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[var] = str(workdir / var.lower())
        os.makedirs(env[var])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    result_path = workdir / "result.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        run.case,
        run.mode,
        run.backend,
        str(workdir),
        str(result_path),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    LIVE.add(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rc = None
    finally:
        LIVE.discard(proc)
    run.wall_s = time.perf_counter() - start
    if result_path.exists():
        result = json.loads(result_path.read_text())
        run.status, run.message = result["status"], result.get("message", "")
        for key in ("build_s", "load_s", "source_kib", "cache_kib"):
            setattr(run, key, result.get(key))
    else:
        run.status = "crash"
        lines = [line for line in output.splitlines() if line.strip()]
        if rc is None:
            run.message = f"timed out after {timeout:.0f} s"
        elif rc < 0:
            run.message = f"killed by {signal.Signals(-rc).name}"
        else:
            run.message = f"exit status {rc}"
        if lines:
            run.message += f"; last output: {lines[-1].strip()}"
    if keep is not None:
        dest = keep / f"{run.case}_{run.mode}_{run.backend}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(
            workdir,
            dest,
            ignore=shutil.ignore_patterns("tmpdir", "torchinductor_cache_dir", "triton_cache_dir"),
        )
        (dest / "output.txt").write_text(output)
        (dest / "wall_s.txt").write_text(f"{run.wall_s:.3f}\n")
    shutil.rmtree(workdir, ignore_errors=True)
    return run


def kept_runs(folders: list[Path]) -> list[Run]:
    """Runs read back from ``--keep`` folders (their result.json and wall_s.txt), in case order."""
    found: dict[tuple[str, str, str], Run] = {}
    for folder in folders:
        for result_path in sorted(folder.glob("*/result.json")):
            case, mode, backend = _run_key(result_path.parent.name)
            result = json.loads(result_path.read_text())
            run = Run(case, mode, backend, result["status"], result.get("message", ""))
            for key in ("build_s", "load_s", "source_kib", "cache_kib"):
                setattr(run, key, result.get(key))
            wall = result_path.parent / "wall_s.txt"
            run.wall_s = float(wall.read_text()) if wall.exists() else math.nan
            found[(case, mode, backend)] = run
    return [
        found[key]
        for key in ((c, m, b) for c in CASES for m in MODES for b in BACKENDS)
        if key in found
    ]


def _run_key(folder: str) -> tuple[str, str, str]:
    """(case, mode, backend) of a kept folder ``{case}_{mode}_{backend}``; modes may hold '_'."""
    rest, backend = folder.rsplit("_", 1)
    mode = max((m for m in MODES if rest.endswith("_" + m)), key=len)
    return rest[: -len(mode) - 1], mode, backend


def fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def summary_line(run: Run, done: int, total: int) -> str:
    parts = [
        f"[{done:>{len(str(total))}}/{total}] {run.case} {run.mode} {run.backend}: {run.status}"
    ]
    if run.build_s is not None:
        parts.append(f"build {run.build_s:.1f} s")
    if run.source_kib is not None:
        parts.append(f"source {run.source_kib:.0f} KiB, cache {run.cache_kib:.0f} KiB")
    parts.append(f"child {run.wall_s:.1f} s")
    line = ", ".join(parts)
    if run.message:
        message = run.message if len(run.message) <= 400 else run.message[:397] + "..."
        line += f"\n    {message}"
    return line


def cell(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def versions() -> str:
    parts = [f"torch {torch.__version__}", f"Python {platform.python_version()}"]
    for module in ("transformers", "timm", "torchvision"):
        try:
            parts.append(f"{module} {__import__(module).__version__}")
        except Exception:
            parts.append(f"{module} not installed")
    return ", ".join(parts)


def write_table(
    out: Path, runs: list[Run], command: str, started: datetime.datetime, elapsed: float
) -> None:
    cases = {run.case: CASES[run.case] for run in runs}
    lines = [
        "# Model zoo",
        "",
        "Written by `benchmarks/zoo.py`: each architecture is built with random weights, "
        "precompiled, saved with `precompile.save`, loaded back with `precompile.load_file` in "
        "the same fresh child process and compared with eager on the same weights (inference: "
        "new inputs, then a second checkpoint; training: three SGD steps' losses, gradients, "
        "final parameters and buffers; train_adamw: three steps with AdamW inside fn (lr 1e-3, "
        "eps 1e-3) from a fresh optimizer, each step's loss, parameters, buffers and optimizer "
        "state). Tolerance rtol 1e-3, atol 1e-4 unless the case says "
        "otherwise. Status: ok; refused (`PrecompileError` at capture); wrong (numbers differ: "
        "where and the max abs diff, and how far eager float32 is from float64 there); error "
        "(another exception: phase, type, first line); crash (the child died or timed out). "
        "A training run whose trajectory drifts from eager's is ok when every step, started "
        "from eager's state, agrees and eager float32 drifts from float64 too; a train_adamw "
        "run that differs is ok when eager float32 differs from float64 at least as much at "
        "every such place; the message says so.",
        "",
        f"- command: `{command}`",
        f"- {versions()}; {os.cpu_count()} CPUs ({platform.machine()})",
        f"- started {started:%Y-%m-%d %H:%M} UTC, {elapsed / 60:.1f} min in all",
        "",
        "## Totals",
        "",
        "| mode | backend | " + " | ".join(STATUSES) + " |",
        "|---|---|" + "---:|" * len(STATUSES),
    ]
    for mode in MODES:
        for backend in BACKENDS:
            subset = [r for r in runs if r.mode == mode and r.backend == backend]
            if subset:
                counts = [sum(r.status == s for r in subset) for s in STATUSES]
                lines.append(f"| {mode} | {backend} | " + " | ".join(map(str, counts)) + " |")
    counts = [sum(r.status == s for r in runs) for s in STATUSES]
    lines.append("| all | all | " + " | ".join(f"**{n}**" for n in counts) + " |")
    lines += [
        "",
        "## Results",
        "",
        "| case | library | mode | backend | status | build s | source KiB | cache KiB | "
        "child s | message |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        status = r.status if r.status == "ok" else f"**{r.status}**"
        lines.append(
            f"| {r.case} | {cases[r.case].library} | {r.mode} | {r.backend} | {status} | "
            f"{fmt(r.build_s)} | {fmt(r.source_kib, 0)} | {fmt(r.cache_kib, 0)} | "
            f"{fmt(r.wall_s)} | {cell(r.message)} |"
        )
    lines += ["", "## Cases", "", "| case | library | what |", "|---|---|---|"]
    for c in cases.values():
        lines.append(f"| {c.name} | {c.library} | {cell(c.what)} |")
    out.write_text("\n".join(lines) + "\n")


def split(value: str, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise SystemExit(
            f"zoo: unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}"
        )
    return items


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        name, mode, backend, workdir, result_path = argv[1:6]
        child(name, mode, backend, Path(workdir), Path(result_path))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help="the Markdown table to write ('-' for none)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="children at once")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of each child (default: CPUs / jobs when jobs > 1, "
        "else torch's default)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=CHILD_TIMEOUT_S,
        help="seconds per child before it counts as a crash",
    )
    parser.add_argument(
        "--keep", default=None, help="copy each child's artifact pair and output into this folder"
    )
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--tracer", default="make_fx", choices=["make_fx", "dynamo"])
    parser.add_argument(
        "--blocks",
        default="auto",
        choices=list(BLOCKS),
        help="precompile's blocks= (on: each repeated block's pieces compiled once even "
        "where that spares little, as for these small models)",
    )
    parser.add_argument(
        "--from-kept",
        default=None,
        metavar="DIRS",
        help="write the table from comma-separated --keep folders of earlier "
        "runs (merging backends run separately) and run nothing",
    )
    args = parser.parse_args(argv)
    if args.list:
        for c in CASES.values():
            print(f"{c.name:24} {c.library:12} {'/'.join(c.modes):11} {c.what}")
        return 0
    if args.from_kept:
        kept = kept_runs([Path(d) for d in args.from_kept.split(",")])
        stamp = min(Path(d).stat().st_mtime for d in args.from_kept.split(","))
        write_table(
            Path(args.out),
            kept,
            shlex.join(["benchmarks/zoo.py", *argv]),
            datetime.datetime.fromtimestamp(stamp, datetime.UTC),
            sum(r.wall_s for r in kept if not math.isnan(r.wall_s)),
        )
        print(f"zoo: wrote {args.out} from {len(kept)} kept runs")
        return 0
    os.environ["ZOO_TRACER"] = args.tracer  # every child inherits it
    os.environ["ZOO_BLOCKS"] = args.blocks
    names = split(args.cases, list(CASES), "case")
    backends = split(args.backends, BACKENDS, "backend")
    modes = split(args.modes, MODES, "mode")
    runs = [
        Run(name, mode, backend)
        for name in names
        for mode in modes
        for backend in backends
        if mode in CASES[name].modes
    ]
    keep = Path(args.keep).resolve() if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    jobs = max(1, args.jobs)
    threads = args.threads
    if threads is None and jobs > 1:
        threads = max(1, (os.cpu_count() or 1) // jobs)
    python = os.path.relpath(sys.executable)
    command = shlex.join(
        [python if not python.startswith("..") else "python", "benchmarks/zoo.py", *argv]
    )
    started = datetime.datetime.now(datetime.UTC)
    start = time.perf_counter()
    print(f"zoo: {len(runs)} runs, {jobs} at a time; {versions()}", flush=True)
    done = 0
    lock = threading.Lock()

    def finished(run: Run) -> None:
        nonlocal done
        with lock:
            done += 1
            print(summary_line(run, done, len(runs)), flush=True)

    pool = concurrent.futures.ThreadPoolExecutor(jobs)
    futures = [pool.submit(run_child, run, args.timeout, threads, keep) for run in runs]
    try:
        for future in concurrent.futures.as_completed(futures):
            finished(future.result())
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(LIVE):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        raise
    pool.shutdown()
    elapsed = time.perf_counter() - start
    counts = {s: sum(r.status == s for r in runs) for s in STATUSES}
    print(
        "zoo: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" in {elapsed / 60:.1f} min",
        flush=True,
    )
    if args.out != "-":
        write_table(Path(args.out), runs, command, started, elapsed)
        print(f"zoo: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
