"""A Hugging Face ``Trainer`` run of a few steps, the model being the module form of a tiny
GPT-2 (random weights, nothing downloaded), against the same run on the model itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_precompile import precompile

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(900)

BATCH, SEQ = 4, 16


def tiny_gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(4 * BATCH):
        ids = torch.randint(0, 64, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def train(model: Any, out: Path) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_a_trainer_trains_the_module_form_like_the_model(tmp_path: Path, backend: str) -> None:
    eager_model, model = tiny_gpt2(), tiny_gpt2()
    example = dataset()[:BATCH]
    batch = {key: torch.stack([row[key] for row in example]) for key in example[0]}
    # The Trainer passes the number of label tokens to a forward that takes **kwargs.
    batch["num_items_in_batch"] = torch.tensor(float(BATCH * SEQ))
    wrapped = precompile.module(model, example_kwargs=batch, backend=backend)
    losses = train(wrapped, tmp_path / "ours")
    eager_losses = train(eager_model, tmp_path / "eager")
    assert len(losses) == 3
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(eager_losses), atol=1e-4, rtol=1e-4
    )
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4, msg=name)
