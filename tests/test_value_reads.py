"""Tensor values read into Python outside the dispatcher are guarded like ``.item()``.

``Tensor.tolist()`` and ``Tensor.numpy()`` read the data in C++, and
``aten._pack_padded_sequence`` reads its lengths inside the operator: the trace bakes what
they read. Each call of an artifact must either match eager or be refused with a
PrecompileError naming the read, and a refused call leaves buffers and inputs as they were.
Python values the traced code reads (sets, named tuples, NumPy scalars and arrays) likewise.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.decorators import mark_unbacked
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from torch_precompile import PrecompileError, precompile

try:
    import numpy as np
except ImportError:  # an optional dependency: the .numpy() test needs it
    np = None

TOLIST_READ = r"values of a tensor read with \.tolist\(\) at test_value_reads\.py:\d+ "
PACKED_READ = (
    r"lengths given to pack_padded_sequence \(aten\._pack_padded_sequence\) at "
    r"test_value_reads\.py:\d+ \(forward\) equal those at capture \(\[5, 3, 2\]\)"
)


class Tagger(torch.nn.Module):
    """A projection and a BatchNorm in eval mode (its buffers are read, never written)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 1.5)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (batch, time, 4)
        return self.norm(h.flatten(0, 1)).unflatten(0, h.shape[:2])


class PackedLSTM(torch.nn.Module):
    """An LSTM over the packed sequences, padded back to the input's length."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lstm = torch.nn.LSTM(3, 4, batch_first=True)
        self.register_buffer("offset", torch.rand(4))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return out + self.offset


def mean_over_lengths(model: Tagger, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    h = model(x)
    return torch.stack([h[i, :n].mean(0) for i, n in enumerate(lengths.tolist())])


def mean_over_numpy_lengths(model: Tagger, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    h = model(x)
    return torch.stack([h[i, : int(n)].mean(0) for i, n in enumerate(lengths.numpy())])


def mean_over_asarray_lengths(
    model: Tagger, x: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    h = model(x)
    return torch.stack([h[i, : int(n)].mean(0) for i, n in enumerate(np.asarray(lengths))])


def mean_over_first_steps(model: Tagger, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    return model(x)[:, : steps.tolist()].mean(1)


def packed_sum(model: PackedLSTM, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return model(x, lengths).sum(1)


def x_of(seed: int, batch: int = 3, time: int = 5) -> torch.Tensor:
    return torch.randn(batch, time, 3, generator=torch.Generator().manual_seed(seed))


def lengths_of(*values: int) -> torch.Tensor:
    return torch.tensor(values)


def check_call(
    run: Callable[..., Any],
    fn: Callable[..., Any],
    model: torch.nn.Module,
    *inputs: torch.Tensor,
    refused: str | None = None,
) -> None:
    """The call matches eager, or (``refused`` a pattern of its message) is refused and
    leaves the model's parameters and buffers and the inputs unchanged."""
    if refused is None:
        with torch.no_grad():
            torch.testing.assert_close(run(model, *inputs), fn(model, *inputs))
        return
    state = {name: t.clone() for name, t in model.state_dict().items()}
    copies = [t.clone() for t in inputs]
    with pytest.raises(PrecompileError, match=refused):
        run(model, *inputs)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, state[name], rtol=0, atol=0, msg=name)
    for t, copy in zip(inputs, copies, strict=True):
        torch.testing.assert_close(t, copy, rtol=0, atol=0, equal_nan=True)


def second_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with the weights (and buffers) of another instance loaded."""
    model.load_state_dict(type(model)(seed).state_dict())
    return model


# -- Tensor.tolist() ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["eager"])
def tolist_run(request: pytest.FixtureRequest) -> Callable[..., Any]:
    code, cache = precompile(
        mean_over_lengths, Tagger(0), x_of(0), lengths_of(5, 3, 2), backend=request.param
    )
    return precompile.load(code, cache)


def test_tolist_lengths_are_guarded(tolist_run: Callable[..., Any]) -> None:
    """Lengths read with .tolist() slice the rows; other lengths are refused.

    before: lengths (4, 4, 2) were off by 0.10 and (2, 3, 5) by 0.33, no error, on both
    backends: the slices of the captured lengths (5, 3, 2) were baked into the graph.
    """
    model = Tagger(0)
    check_call(tolist_run, mean_over_lengths, model, x_of(1), lengths_of(5, 3, 2))
    check_call(
        tolist_run,
        mean_over_lengths,
        model,
        x_of(2),
        lengths_of(4, 4, 2),
        refused=r"left the path.*whether the "
        + TOLIST_READ
        + r"\(mean_over_lengths\) equal those at capture was True at capture and is False",
    )
    check_call(
        tolist_run, mean_over_lengths, model, x_of(3), lengths_of(2, 3, 5), refused=TOLIST_READ
    )
    check_call(tolist_run, mean_over_lengths, model, x_of(4), lengths_of(5, 3, 2))


def test_tolist_guard_holds_with_second_weights(tolist_run: Callable[..., Any]) -> None:
    """Other weights leave the lengths' path as it was: same lengths run, others refused.

    before: lengths (5, 5, 5) with the second weights were off by 0.40, no error (both
    backends).
    """
    model = second_weights(Tagger(0), seed=1)
    check_call(tolist_run, mean_over_lengths, model, x_of(5), lengths_of(5, 3, 2))
    check_call(
        tolist_run, mean_over_lengths, model, x_of(6), lengths_of(5, 5, 5), refused=TOLIST_READ
    )
    check_call(tolist_run, mean_over_lengths, model, x_of(7), lengths_of(5, 3, 2))


@pytest.mark.parametrize("fn", [mean_over_numpy_lengths, mean_over_asarray_lengths])
def test_numpy_reads_are_guarded(fn: Callable[..., torch.Tensor]) -> None:
    """Tensor.numpy() and numpy.asarray(tensor) read the data as .tolist() does.

    before: lengths (4, 4, 2) were off by 0.10, and (5, 5, 5) with the second weights by
    0.40, no error.
    """
    if np is None:
        pytest.skip("numpy is not installed")
    code, cache = precompile(fn, Tagger(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    run = precompile.load(code, cache)
    model = Tagger(0)
    read = r"values of a tensor read with \.numpy\(\) at test_value_reads\.py:\d+ "
    check_call(run, fn, model, x_of(1), lengths_of(5, 3, 2))
    check_call(run, fn, model, x_of(2), lengths_of(4, 4, 2), refused=read)
    check_call(run, fn, model, x_of(3), lengths_of(5, 3, 2))
    second_weights(model, seed=1)
    check_call(run, fn, model, x_of(4), lengths_of(5, 3, 2))
    check_call(run, fn, model, x_of(5), lengths_of(5, 5, 5), refused=read)


def test_one_value_read_with_tolist_names_both_values() -> None:
    """A 0-dim tensor's .tolist() is one number; the refusal shows it then and now.

    before: steps 4 returned the mean over the first 3 steps (off by 0.36), no error.
    """
    fn = mean_over_first_steps
    code, cache = precompile(fn, Tagger(0), x_of(0), torch.tensor(3), backend="eager")
    run = precompile.load(code, cache)
    guards = precompile.inspect(code).value_guards
    assert [g.expected for g in guards] == [("const", 3)]
    model = Tagger(0)
    check_call(run, fn, model, x_of(1), torch.tensor(3))
    check_call(
        run,
        fn,
        model,
        x_of(2),
        torch.tensor(4),
        refused=r"the value of a tensor read with \.tolist\(\) at test_value_reads\.py:"
        r"\d+ \(mean_over_first_steps\) was 3 at capture and is 4 now",
    )
    check_call(run, fn, model, x_of(3), torch.tensor(3))
    second_weights(model, seed=1)
    check_call(run, fn, model, x_of(4), torch.tensor(3))
    check_call(run, fn, model, x_of(5), torch.tensor(2), refused="was 3 at capture and is 2")


def test_same_values_with_nan_pass_the_guard() -> None:
    """NaN equals NaN for the guard: the same values pass, other ones are refused.

    before: weights (0.5, 1.0, 2.0) used the captured factor 2.5 instead of 3.5, no error.
    """

    def scaled(model: Tagger, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        factor = sum(w for w in weights.tolist() if w == w)  # NaN skipped
        return model(x) * factor

    weights = torch.tensor([0.5, float("nan"), 2.0])
    code, cache = precompile(scaled, Tagger(0), x_of(0), weights, backend="eager")
    run = precompile.load(code, cache)
    model = Tagger(0)
    check_call(run, scaled, model, x_of(1), weights.clone())
    check_call(run, scaled, model, x_of(2), torch.tensor([0.5, 1.0, 2.0]), refused=TOLIST_READ)
    check_call(run, scaled, model, x_of(3), torch.tensor([0.5, float("nan"), 2.0]))
    second_weights(model, seed=1)
    check_call(run, scaled, model, x_of(4), weights.clone())


@pytest.mark.parametrize(
    "read",
    [
        lambda t: [int(v) for v in t],
        lambda t: list(map(int, t)),
        lambda t: [float(v) for v in list(t)],
    ],
)
def test_iterating_then_converting_is_guarded_per_element(read: Callable[..., list[Any]]) -> None:
    """``for v in t`` and ``list(t)`` yield tensors (no read); int()/float() of each is an
    .item() read, guarded element by element."""

    def fn(model: Tagger, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = model(x)
        return torch.stack([h[i, : int(n)].mean(0) for i, n in enumerate(read(lengths))])

    code, cache = precompile(fn, Tagger(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    run = precompile.load(code, cache)
    assert len(precompile.inspect(code).value_guards) == 3
    model = Tagger(0)
    check_call(run, fn, model, x_of(1), lengths_of(5, 3, 2))
    check_call(
        run,
        fn,
        model,
        x_of(2),
        lengths_of(5, 4, 2),
        refused=r"a tensor value read into Python .* was 3 at capture and is 4 now",
    )
    check_call(run, fn, model, x_of(3), lengths_of(5, 3, 2))


def test_reading_too_many_values_is_refused_at_capture() -> None:
    """A guard compares against a literal written into the artifact: at most 65536 values."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * max(x.tolist())

    with pytest.raises(
        PrecompileError,
        match=r"fn reads 70000 values of a tensor with "
        r"\.tolist\(\) at test_value_reads\.py:\d+ \(fn\).*Keep the computation "
        "on tensors",
    ):
        precompile(fn, torch.rand(70000), backend="eager")
    assert "tolist" not in vars(torch.Tensor)


def test_printing_a_tensor_is_no_read(capsys: pytest.CaptureFixture[str]) -> None:
    """Printing reads values with .tolist() with the trace's modes off: no guard."""

    def fn(model: Tagger, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        print(lengths, x[0, 0])
        return model(x) * lengths.reshape(-1, 1, 1)

    code, cache = precompile(fn, Tagger(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    assert precompile.inspect(code).value_guards == ()
    run = precompile.load(code, cache)
    model = Tagger(0)
    check_call(run, fn, model, x_of(1), lengths_of(4, 4, 1))
    check_call(run, fn, model, x_of(2), lengths_of(1, 2, 3))
    second_weights(model, seed=1)
    check_call(run, fn, model, x_of(3), lengths_of(2, 2, 2))
    assert "tensor([5, 3, 2])" in capsys.readouterr().out


def test_methods_are_restored_after_capture_and_after_a_failing_fn() -> None:
    originals = (torch.Tensor.tolist, torch.Tensor.numpy)
    owned = ("tolist" in vars(torch.Tensor), "numpy" in vars(torch.Tensor))
    precompile(mean_over_lengths, Tagger(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    assert (torch.Tensor.tolist, torch.Tensor.numpy) == originals

    def failing(model: Tagger, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths.tolist()
        raise ValueError("fn's own error")

    with pytest.raises(ValueError, match="fn's own error"):
        precompile(failing, Tagger(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    assert (torch.Tensor.tolist, torch.Tensor.numpy) == originals
    assert ("tolist" in vars(torch.Tensor), "numpy" in vars(torch.Tensor)) == owned


def read_in_another_thread() -> list[Any]:
    """What ``.tolist()`` of a tensor returns in a thread started and joined here."""
    seen: list[Any] = []
    other = threading.Thread(target=lambda: seen.append(torch.arange(4).tolist()))
    other.start()
    other.join()
    return seen


def test_reads_of_another_thread_are_not_recorded() -> None:
    """The patch is process-wide while a trace runs; only the tracing thread's reads count."""

    def fn(model: Tagger, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        assert read_in_another_thread() == [[0, 1, 2, 3]]
        return mean_over_lengths(model, x, lengths)

    code, _ = precompile(fn, Tagger(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    descriptions = [g.description for g in precompile.inspect(code).value_guards]
    assert len(descriptions) == 1 and re.search(
        TOLIST_READ + r"\(mean_over_lengths\)", descriptions[0]
    )


# -- What a refused call puts back; reads the trace cannot follow ---------------------------


class Normed(torch.nn.Module):
    """Doubles its input in place, then a BatchNorm in training mode (which writes its running
    statistics in place) and a decision on the input's values; ``unused`` gets no gradient."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm, self.fc, self.unused = (
            torch.nn.BatchNorm1d(4),
            torch.nn.Linear(4, 4),
            torch.nn.Linear(4, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = self.fc(self.norm(x))
        return h if bool(x.sum() > 0) else -h


def normed(model: Normed, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def normed_step(model: Normed, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.lowering
def test_a_refused_call_puts_back_the_batchnorm_statistics(backend: str) -> None:
    """before: the refused call left running_mean and running_var updated (num_batches_tracked
    and the input were put back): native_batch_norm writes them though its schema does not
    say so and their version counters do not move, so the spec's written inputs lacked them."""
    x = torch.rand(6, 4) + 0.1
    with torch.no_grad():
        code, cache = precompile(normed, Normed(0), x.clone(), backend=backend)
        run, model, eager = precompile.load(code, cache), Normed(0), Normed(0)
        torch.testing.assert_close(run(model, x.clone()), normed(eager, x.clone()))
        torch.testing.assert_close(model.state_dict(), eager.state_dict())
        check_call(run, normed, model, -x, refused=r"left the path.*is put back")


def test_a_refused_training_step_puts_back_statistics_parameters_and_optimizer_state() -> None:
    """An optimizer inside fn, over a parameter without gradient too (whose state the graph
    drops, so the written inputs after it move down).

    before: IndexError at the first call (the written inputs kept their places from before
    the drop); the refused call left running_mean and running_var updated."""
    x = torch.rand(6, 4) + 0.1
    model = Normed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    code, cache = precompile(normed_step, model, opt, x.clone(), backend="eager")
    run = precompile.load(code, cache)
    run(model, opt, x.clone())  # the momentum buffers exist from here on
    model.zero_grad()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    momenta = {p: s["momentum_buffer"].clone() for p, s in opt.state.items()}
    given = -x
    with pytest.raises(PrecompileError, match=r"left the path.*is put back"):
        run(model, opt, given)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, state[name], rtol=0, atol=0, msg=name)
    for p, momentum in momenta.items():
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], momentum, rtol=0, atol=0)
    torch.testing.assert_close(given, -x, rtol=0, atol=0)


def first_stored_value(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) * float(x.contiguous().untyped_storage()[0])


def own_not_implemented(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("fn's own error")


def test_reading_a_tensor_through_its_storage_is_refused_at_capture() -> None:
    """before: ``NotImplementedError: argument of type: <class 'torch.storage.UntypedStorage'>``
    from torch.fx, naming neither fn's line nor what to do. fn's own NotImplementedError still
    reaches the caller unchanged."""
    with pytest.raises(
        PrecompileError,
        match=r"through its storage at test_value_reads\.py:\d+ \(first_stored_value\).*"
        r"Use tensor operations instead",
    ):
        precompile(first_stored_value, torch.nn.Linear(4, 4), torch.randn(2, 4), backend="eager")
    with pytest.raises(NotImplementedError, match="fn's own error") as raised:
        precompile(own_not_implemented, torch.nn.Linear(4, 4), torch.randn(2, 4), backend="eager")
    assert type(raised.value) is NotImplementedError


# -- pack_padded_sequence -------------------------------------------------------------------


@pytest.fixture(scope="module", params=["eager"])
def packed_run(request: pytest.FixtureRequest) -> Callable[..., Any]:
    code, cache = precompile(
        packed_sum, PackedLSTM(0), x_of(0), lengths_of(5, 3, 2), backend=request.param
    )
    return precompile.load(code, cache)


def test_packed_lengths_are_guarded(packed_run: Callable[..., Any]) -> None:
    """The packing is traced for the captured lengths (in any order); others are refused.

    before: eager: lengths (4, 4, 2) were off by 0.18 and (5, 4, 1) by 0.37 with no error;
    (4, 4, 1) failed with a raw RuntimeError (output with shape [1, 16] doesn't match the
    broadcast shape [0, 16]). inductor: the build was refused with Inductor's internal
    message (failed while retracing ... at operator aten.add_.Tensor: Attempting to
    broadcast a dimension of length 2).
    """
    model = PackedLSTM(0)
    check_call(packed_run, packed_sum, model, x_of(1), lengths_of(2, 5, 3))
    check_call(
        packed_run,
        packed_sum,
        model,
        x_of(2),
        lengths_of(4, 4, 2),
        refused=r"left the path.*whether the " + PACKED_READ + " was True at capture "
        "and is False now",
    )
    check_call(packed_run, packed_sum, model, x_of(3), lengths_of(5, 4, 1), refused=PACKED_READ)
    check_call(packed_run, packed_sum, model, x_of(4), lengths_of(4, 4, 1), refused=PACKED_READ)
    check_call(packed_run, packed_sum, model, x_of(5), lengths_of(3, 2, 5))


def test_packing_has_one_guard_the_lengths() -> None:
    """The RNN's reads of the batch sizes are fixed by the lengths' guard: no guard of their
    own.

    before: two guards, both on batch_sizes[0] (the longest length), none on the lengths.
    """
    code, _ = precompile(packed_sum, PackedLSTM(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    guards = precompile.inspect(code).value_guards
    assert [g.expected for g in guards] == [("const", True)]
    assert re.search(PACKED_READ, guards[0].description)


def test_packed_lengths_with_second_weights(packed_run: Callable[..., Any]) -> None:
    """before: eager: lengths (5, 4, 1) with the second weights were off by 0.73, no error;
    inductor: no artifact (see above)."""
    model = second_weights(PackedLSTM(0), seed=1)
    check_call(packed_run, packed_sum, model, x_of(6), lengths_of(5, 3, 2))
    check_call(packed_run, packed_sum, model, x_of(7), lengths_of(5, 4, 1), refused=PACKED_READ)
    check_call(packed_run, packed_sum, model, x_of(8), lengths_of(2, 3, 5))


def test_packed_training_step_matches_eager() -> None:
    """Gradients flow through the fixed-index packing as through the operator."""

    def step(model: PackedLSTM, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        loss = packed_sum(model, x, lengths).pow(2).sum()
        loss.backward()
        return loss

    code, cache = precompile(step, PackedLSTM(0), x_of(0), lengths_of(5, 3, 2), backend="eager")
    run = precompile.load(code, cache)
    for seed, lengths in [(1, lengths_of(3, 5, 2)), (2, lengths_of(5, 3, 2))]:
        ours, theirs = PackedLSTM(seed), PackedLSTM(seed)
        torch.testing.assert_close(
            run(ours, x_of(seed), lengths), step(theirs, x_of(seed), lengths)
        )
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    check_call(run, step, PackedLSTM(3), x_of(3), lengths_of(4, 4, 2), refused=PACKED_READ)


def test_packing_with_a_dynamic_dim_is_refused_by_inductor() -> None:
    """Marked dims trace on fakes: the lengths cannot be fixed, so the operator stays.

    before: the build succeeded and every call failed with a raw RuntimeError from the
    operator's fake implementation (expected size 10==5, stride 3==3 at dim=0).
    """

    def pack_only(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False).data * 2

    x = x_of(0)
    mark_unbacked(x, 2)
    with pytest.raises(
        PrecompileError,
        match=r"pack_padded_sequence \(aten\._pack_padded_"
        r"sequence\) at test_value_reads\.py:\d+.*Leave the dims static.*pad "
        "and mask",
    ):
        precompile(pack_only, x, lengths_of(5, 3, 2), backend="inductor")


def unpack_lengths(x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    out, found = pad_packed_sequence(packed, batch_first=True)
    return out * 2, found


def test_pad_packed_sequence_returns_the_lengths(backend: str) -> None:
    """The lengths pad_packed_sequence returns are written by the operator in C++. Before:
    the artifact returned uninitialized memory in their place (tensor([94330578363312, ...])
    for [5, 3, 2])."""
    x = torch.randn(3, 5, 2)
    run = precompile.load(*precompile(unpack_lengths, x, torch.tensor([5, 3, 2]), backend=backend))
    for lengths in ([5, 3, 2], [2, 5, 3], [3, 2, 5]):
        x = torch.randn(3, 5, 2)
        torch.testing.assert_close(
            run(x, torch.tensor(lengths)), unpack_lengths(x, torch.tensor(lengths))
        )


MAIN_SCRIPT = """
import sys, torch
from torch_precompile import PrecompileError, precompile
SCALE = float(sys.argv[2])
def scaled(m, x):
    return m(x) * SCALE
torch.manual_seed(0)
m, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
if sys.argv[1] == "build":
    with torch.no_grad():
        precompile.save(*precompile(scaled, m, x, backend="eager"), "scaled.py")
else:
    try:
        with torch.no_grad():
            torch.testing.assert_close(precompile.load_file("scaled.py")(m, x), scaled(m, x))
        print("RAN")
    except PrecompileError as e:
        print("REFUSED", e)
"""


@pytest.mark.default_release  # the package's own lookup, in fresh processes
def test_a_global_of_the_main_script_is_checked_by_script_name(tmp_path) -> None:
    """A global of ``__main__`` is compared when the same script runs again (known by its base
    name: the spec holds no path of the build machine) and must be as at capture."""
    import subprocess
    import sys

    (tmp_path / "serve.py").write_text(MAIN_SCRIPT)

    def run(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "serve.py", *args],
            cwd=tmp_path,
            text=True,
            capture_output=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    run("build", "2")
    reads = precompile.inspect((tmp_path / "scaled.py").read_text()).read_values
    assert [(r.module, r.path, r.file) for r in reads] == [("__main__", ("SCALE",), "serve.py")]
    assert run("load", "2").startswith("RAN")
    refused = run("load", "3")
    assert refused.startswith("REFUSED") and "SCALE" in refused, refused


# -- Python values of other kinds the trace reads: sets, named tuples, NumPy values --------


needs_numpy = pytest.mark.skipif(np is None, reason="needs numpy")


def built(fn: Callable[..., Any], model: torch.nn.Module, x: torch.Tensor) -> Callable[..., Any]:
    return precompile.load(*precompile(fn, model, x, backend="eager"))


def run_model(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


class Skipping(torch.nn.Module):
    """Skips the layers whose index is in ``skip`` (a set, as configs hold them)."""

    def __init__(self, skip: set[int] | frozenset[int] = frozenset()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(3))
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = layer(x)
        return x


SKIPPED = frozenset({0})  # a global frozenset: fn skips these layers


def skip_by_global(model: Skipping, x: torch.Tensor) -> torch.Tensor:
    for i, layer in enumerate(model.layers):
        if i not in SKIPPED:
            x = layer(x)
    return x


def test_a_set_attribute_is_checked_in_place_too() -> None:
    """A set read in forward is compared by its items, also after a passing call (the
    remembered path). Before: a set was not recorded; one changed in place or rebound after
    capture gave another model's result with no error."""
    model, x = Skipping({1}), x_of(0)
    run = built(run_model, model, x)
    check_call(run, run_model, model, x)
    check_call(run, run_model, model, x)  # the remembered path
    model.skip.add(2)
    check_call(
        run,
        run_model,
        model,
        x,
        refused=r"attribute 'skip' of the model is \{1, 2\}, but "
        r"was \{1\} when the trace read it",
    )
    model.skip.discard(2)
    check_call(run, run_model, model, x)
    model.skip = frozenset({1})
    check_call(
        run,
        run_model,
        model,
        x,
        refused=r"attribute 'skip' of the model is frozenset\("
        r"\{1\}\), but was \{1\}",
    )
    model.skip = {1}
    check_call(run, run_model, model, x)


def test_a_frozenset_global_is_checked() -> None:
    """A global frozenset must hold the same items at every call. Before: a rebound one was
    not seen."""
    global SKIPPED
    model, x = Skipping(), x_of(0)
    run = built(skip_by_global, model, x)
    check_call(run, skip_by_global, model, x)
    check_call(run, skip_by_global, model, x)
    try:
        SKIPPED = frozenset({0, 2})
        check_call(
            run,
            skip_by_global,
            model,
            x,
            refused=r"global 'SKIPPED' of module \S+ is "
            r"frozenset\(\{0, 2\}\), but was frozenset\(\{0\}\) when the trace read it",
        )
        SKIPPED = frozenset({0})  # an equal one, another object
        check_call(run, skip_by_global, model, x)
    finally:
        SKIPPED = frozenset({0})


class Scales(typing.NamedTuple):
    factor: float
    shift: float = 0.0


Offsets = collections.namedtuple("Offsets", "bias")
OFFSETS = Offsets(0.5)  # a global named tuple


class Rescaled(torch.nn.Module):
    """Scales a projection by a named tuple of options it holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(3, 3)
        self.scales = Scales(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scales.factor + self.scales.shift + OFFSETS.bias


def test_a_named_tuple_is_checked_field_by_field() -> None:
    """A named tuple (attribute or global) is compared as its class and fields. Before: a named
    tuple was not recorded (a plain tuple was), so a rebound one went unseen."""
    global OFFSETS
    model, x = Rescaled(), x_of(0)
    run = built(run_model, model, x)
    check_call(run, run_model, model, x)
    model.scales = Scales(3.0)
    check_call(
        run,
        run_model,
        model,
        x,
        refused=r"attribute 'scales' of the model is "
        r"Scales\(factor=3\.0, shift=0\.0\), but was \S*Scales\(factor=2\.0, shift=0\.0\)",
    )
    model.scales = (2.0, 0.0)  # a plain tuple of the same values is another type
    check_call(
        run, run_model, model, x, refused=r"attribute 'scales' of the model is \(2\.0, 0\.0\)"
    )
    model.scales = Scales(2.0)
    check_call(run, run_model, model, x)
    try:
        OFFSETS = Offsets(1.5)
        check_call(
            run,
            run_model,
            model,
            x,
            refused=r"global 'OFFSETS' of module \S+ is "
            r"Offsets\(bias=1\.5\), but was \S*Offsets\(bias=0\.5\)",
        )
    finally:
        OFFSETS = Offsets(0.5)
    check_call(run, run_model, model, x)


class Gained(torch.nn.Module):
    """Multiplies by a NumPy scalar and subtracts a NumPy array it holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(3, 3)
        self.gain = np.float32(2.0)
        self.mean = np.array([0.5, -1.0, 2.0], dtype=np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) - torch.from_numpy(self.mean)) * float(self.gain)


@needs_numpy
def test_a_numpy_scalar_is_checked_by_type_and_value() -> None:
    """A NumPy scalar read is compared by its NumPy type and its value. Before: not recorded,
    so another gain gave the captured gain's result."""
    model, x = Gained(), x_of(0)
    run = built(run_model, model, x)
    check_call(run, run_model, model, x)
    model.gain = np.float32(3.0)
    check_call(
        run,
        run_model,
        model,
        x,
        refused=r"attribute 'gain' of the model is .*, but was "
        r"numpy\.float32\(2\.0\) when the trace read it",
    )
    model.gain = np.float64(2.0)
    check_call(
        run,
        run_model,
        model,
        x,
        refused=r"attribute 'gain' of the model is .*, but was "
        r"numpy\.float32\(2\.0\)",
    )
    model.gain = np.float32(2.0)
    check_call(run, run_model, model, x)


MEAN = np.array([[0.5, -1.0, 2.0]], dtype=np.float32) if np is not None else None


def centre_by_global(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x - torch.from_numpy(MEAN))


@needs_numpy
def test_a_numpy_array_is_checked_in_place_too() -> None:
    """A small NumPy array (attribute or global) is compared by dtype, shape and elements at
    every call, also after a passing call. Before: not recorded, so an array changed in place
    or rebound gave the captured values' result."""
    model, x = Gained(), x_of(0)
    code, cache = precompile(centre_by_global, model, x, backend="eager")
    kinds = {r.path: r.expected[0] for r in precompile.inspect(code).read_values}
    assert kinds.items() >= {("gain",): "numpy", ("mean",): "ndarray", ("MEAN",): "ndarray"}.items()
    run = precompile.load(code, cache)
    check_call(run, centre_by_global, model, x)
    check_call(run, centre_by_global, model, x)  # the remembered path
    model.mean[1] = 4.0
    check_call(
        run,
        centre_by_global,
        model,
        x,
        refused=r"attribute 'mean' of the model is "
        r"array\(.*\), but was array\(\[0\.5, -1\.0, 2\.0\], dtype=float32\)",
    )
    model.mean[1] = -1.0
    check_call(run, centre_by_global, model, x)
    model.mean = model.mean.astype(np.float64)
    check_call(run, centre_by_global, model, x, refused=r"attribute 'mean' of the model")
    model.mean = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    check_call(run, centre_by_global, model, x)
    try:
        MEAN[0, 0] = 1.0
        check_call(
            run,
            centre_by_global,
            model,
            x,
            refused=r"global 'MEAN' of module \S+ is "
            r"array\(.*\), but was array\(\[\[0\.5, -1\.0, 2\.0\]\], dtype=float32\)",
        )
    finally:
        MEAN[0, 0] = 0.5
    check_call(run, centre_by_global, model, x)


# -- Reads the attribute chain alone does not show --------------------------------------


class Settings:
    """Settings kept as class attributes, read through the class (``Settings.SCALE``)."""

    SCALE = 2.0


class Slotted:
    """A config object without an instance dict."""

    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale


class Helper:
    """A plain object whose method reads its own attribute."""

    def __init__(self, k: float) -> None:
        self.k = k

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class Indirect(torch.nn.Module):
    """Reads values in ways an attribute chain off ``self`` does not show."""

    factor = 2.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 3)
        self.cfg = Slotted(2.0)
        self.helper = Helper(2.0)
        self.offset = 1.0

    @classmethod
    def class_factor(cls) -> float:
        return cls.factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if hasattr(self, "post_scale"):
            y = y * 3
        y = y * getattr(self, "mult", 1.0) * type(self).factor * self.class_factor()
        y = self.helper.apply(y) * self.cfg.scale * Settings.SCALE
        return y + vars(self)["offset"]


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        (
            lambda m: setattr(m, "post_scale", 1.0),
            r"attribute 'post_scale' of the model is 1\.0, "
            r"but was missing",
        ),
        (
            lambda m: setattr(m, "mult", 2.0),
            r"attribute 'mult' of the model is 2\.0, but was "
            r"missing",
        ),
        (
            lambda m: setattr(Indirect, "factor", 3.0),
            r"class attribute 'factor' of the model's "
            r"class is 3\.0",
        ),
        (
            lambda m: setattr(Settings, "SCALE", 3.0),
            r"global 'Settings\.SCALE' of module "
            r"test_value_reads is 3\.0",
        ),
        (lambda m: setattr(m.cfg, "scale", 3.0), r"attribute 'cfg\.scale' of the model is 3\.0"),
        (lambda m: setattr(m.helper, "k", 3.0), r"attribute 'helper\.k' of the model is 3\.0"),
        (lambda m: setattr(m, "offset", 2.0), r"attribute 'offset' of the model is 2\.0"),
    ],
    ids=["hasattr", "getattr-default", "type-self", "class-global", "slots", "helper", "vars"],
)
def test_values_read_past_the_attribute_chain_are_checked(
    change: Callable[[Indirect], None], refused: str
) -> None:
    """An attribute absent at capture (``hasattr``, ``getattr`` with a default), a class
    attribute read through ``type(self)`` or a classmethod's ``cls``, a user's class read as
    settings, a slotted config, a helper object's own attribute and ``vars(self)``. Before:
    each was baked in, and a change after capture went unseen."""
    model, x = Indirect(), torch.randn(2, 3)
    run = built(run_model, model, x)
    check_call(run, run_model, model, x)
    check_call(run, run_model, model, x)  # the remembered path
    saved = (Indirect.factor, Settings.SCALE)
    try:
        change(model)
        check_call(run, run_model, model, x, refused=refused)
    finally:
        Indirect.factor, Settings.SCALE = saved


class WithLambda(torch.nn.Module):
    """An activation held as a lambda, as research code often does."""

    def __init__(self, factor: float = 2.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 3)
        self.act = lambda y: y * factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def test_a_lambda_attribute_is_checked_by_its_code_and_closure() -> None:
    """A lambda is compared by its code and the plain values it closes over, so a twin model
    (a new lambda, the same code) runs and another lambda is refused. Before: lambdas were
    not recorded (their name says nothing), and a replaced one went unseen."""
    model, x = WithLambda(), torch.randn(2, 3)
    run = built(run_model, model, x)
    check_call(run, run_model, model, x)
    check_call(run, run_model, WithLambda(), x)  # a new lambda, same code and closure
    check_call(
        run,
        run_model,
        WithLambda(3.0),
        x,
        refused=r"attribute 'act' of the model is test_value_reads\.WithLambda\.__init__\."
        r"<locals>\.<lambda>, but was test_value_reads\.WithLambda\.__init__\.<locals>\."
        r"<lambda> \(its code and closure as at capture\)",
    )
    model.act = lambda y: y * 2.0
    check_call(run, run_model, model, x, refused=r"attribute 'act' of the model is ")


_DIGEST = """
from torch_precompile.shipped.driver.encoded import code_digest
print(code_digest(lambda y, tag="a": y if tag in {"relu", "gelu", "silu"} else -y))
"""


@pytest.mark.default_release  # the package's own lookup, in fresh processes
def test_a_lambdas_digest_is_the_same_in_every_process() -> None:
    """A set constant's order follows string hashing, which differs by process: the digest
    must not (else every other process would refuse the artifact)."""
    digests = {
        subprocess.run(
            [sys.executable, "-c", _DIGEST],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1 and len(next(iter(digests))) == 16, digests


# -- Values out of the attribute chain's sight: objects in containers, loops, hooks ------


class Gate(torch.nn.Module):
    """A layer with a flag and a scale that its parent reads in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.on = True
        self.scale = 2.0
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class HookSettings:
    """A forward hook object whose setting sits one object down (``self.inner.scale``)."""

    def __init__(self) -> None:
        self.inner = Helper(2.0)

    def __call__(self, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * self.inner.k


class Looped(torch.nn.Module):
    """Reads values through objects in lists, dicts and tuples, off the layers a loop takes
    from a ModuleList (``layer.scale``, ``getattr(layer, "skip", False)``), and off a
    submodule named or indexed (``self.head.gain``, ``self.layers[1].gain``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Gate() for _ in range(2))
        self.head = Gate()
        self.specs = [Helper(2.0)]
        self.named = {"out": Helper(1.5)}
        self.pair = (Helper(1.0),)
        self.hook_settings = HookSettings()
        self.layers[1].register_forward_hook(self.hook_settings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if getattr(layer, "skip", False) or not getattr(layer, "on", True):
                continue
            x = layer(x) * layer.scale
        for spec in self.pair:
            x = spec.apply(x)
        x = self.head(x) * self.head.gain * self.layers[1].gain
        return self.specs[0].apply(x) * self.named["out"].k


LOOPED_CHANGES = {
    "list-object": (
        lambda m: setattr(m.specs[0], "k", 3.0),
        r"attribute 'specs' of the model is \[test_value_reads\.Helper\(k=3\.0\)\], but was "
        r"\[test_value_reads\.Helper\(k=2\.0\)\]",
    ),
    "dict-object": (
        lambda m: setattr(m.named["out"], "k", 3.0),
        r"attribute 'named' of the model is \{'out': test_value_reads\.Helper\(k=3\.0\)\}",
    ),
    "tuple-object": (lambda m: setattr(m.pair[0], "k", 3.0), r"attribute 'pair' of the model"),
    "loop-attribute": (
        lambda m: setattr(m.layers[0], "scale", 3.0),
        r"attribute 'scale' of module 'layers\.0' is 3\.0, but was 2\.0",
    ),
    "loop-getattr": (
        lambda m: setattr(m.layers[1], "on", False),
        r"attribute 'on' of module 'layers\.1' is False, but was True",
    ),
    "loop-getattr-absent": (
        lambda m: setattr(m.layers[1], "skip", True),
        r"attribute 'skip' of module 'layers\.1' is True, but was missing",
    ),
    "submodule-attribute": (
        lambda m: setattr(m.head, "gain", 3.0),
        r"attribute 'gain' of module 'head' is 3\.0, but was 1\.0",
    ),
    "indexed-submodule-attribute": (
        lambda m: setattr(m.layers[1], "gain", 3.0),
        r"attribute 'gain' of module 'layers\.1' is 3\.0, but was 1\.0",
    ),
    "hook-object": (
        lambda m: setattr(m.hook_settings.inner, "k", 3.0),
        r"module 'layers\.1' has hooks forward: test_value_reads\.HookSettings "
        r"inner=Helper\(k=3\.0\), but had forward: test_value_reads\.HookSettings "
        r"inner=Helper\(k=2\.0\)",
    ),
}


@pytest.fixture(scope="module", params=["eager"])
def looped_run(request: pytest.FixtureRequest) -> Callable[..., Any]:
    with torch.no_grad():
        return precompile.load(
            *precompile(run_model, Looped(), torch.randn(2, 3), backend=request.param)
        )


@pytest.mark.parametrize("case", list(LOOPED_CHANGES))
def test_values_out_of_the_attribute_chains_sight_are_checked(
    looped_run: Callable[..., Any], case: str
) -> None:
    """An object's value read through a list, dict or tuple attribute, a layer's value read
    off the loop variable of ``for layer in self.layers`` (present or absent at capture) or
    off a submodule (``self.head.gain``, ``self.layers[1].gain``), and a hook object's
    setting one object down: each changed in place after a passing call is
    refused, with nothing written, and set back the call agrees with eager again. Before:
    each gave the capture's result with no error."""
    change, refused = LOOPED_CHANGES[case]
    model, x = Looped(), torch.randn(2, 3)
    check_call(looped_run, run_model, model, x)
    check_call(looped_run, run_model, model, x)  # the remembered path
    change(model)
    check_call(looped_run, run_model, model, x, refused=refused)
    fresh = Looped()  # the same values in other objects: they pass
    check_call(looped_run, run_model, fresh, x)
