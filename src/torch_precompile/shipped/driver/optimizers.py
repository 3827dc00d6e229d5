"""The driver part for optimizer arguments: their state and learning rates as flat inputs.

Each call checks every optimizer against its capture: its class, no step hooks, each param
group stepping the same model parameters in the same order with the same baked options, no
gradient left on a parameter from before the call (the captured step starts from none; when
fn itself calls ``zero_grad()`` first, those gradients are dropped as it would), and
each state tensor's shape, dtype, device and layout. A parameter without state gets zero state,
which its first step starts from; it is installed only once every check has passed. The graph
then updates the optimizer's own state tensors in place, and the optimizer is marked as stepped
for an LR scheduler. Its touches of torch.optim's private state: the step hooks
(``_optimizer_step_pre_hooks`` and ``_post_hooks``, per optimizer and global) and the
``_opt_called`` flag an LR scheduler reads.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.planned import TensorPlan, check_planned
from torch_precompile.shipped.driver.tensor_rules import PrecompileError, qualified_name


class OptimizerSteps:
    """The captured optimizers, in argument order: ``plans`` (one ``OptimizerPlan`` each)."""

    def __init__(self, plans: Sequence["OptimizerPlan"]) -> None:
        self.plans = list(plans)

    def flat_inputs(self, args: Sequence[Any], state: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every optimizer's state tensors, then every param group's lr."""
        checked = [plan.check(args[plan.position], state) for plan in self.plans]
        lrs = [
            plan.learning_rate(number, group)
            for plan, (optimizer, _) in zip(self.plans, checked, strict=True)
            for number, group in enumerate(optimizer.param_groups)
        ]
        # Every check has passed: only now does anything change.
        tensors: list[torch.Tensor] = []
        for plan, (optimizer, fresh) in zip(self.plans, checked, strict=True):
            if plan.zero_grad_first:  # what fn's own zero_grad() does first in eager
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None
            for param, entries in fresh.items():
                optimizer.state[param].update(entries)
            tensors.extend(optimizer.state[state[e.param]][e.key] for e in plan.entries)
        return [*tensors, *lrs]

    def stepped(self, args: Sequence[Any]) -> None:
        """What an eager step leaves for others: an LR scheduler sees the optimizer stepped."""
        for plan in self.plans:
            optimizer = args[plan.position]
            if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
                optimizer._opt_called = True


def optimizer_steps(driver: "Driver") -> OptimizerSteps:
    """The generic driver's optimizers, planned from its spec records."""
    spec = driver.spec
    index = {t.name: i for i, t in enumerate(driver.model.interned)}
    positions = [i for i, a in enumerate(spec.args) if a.is_optimizer]
    plans = []
    for number, record in enumerate(spec.optimizers):
        groups = [g for g in spec.param_groups if g.optimizer == number]
        fresh = {name: g.fresh_start for g in groups for name in g.params}
        plans.append(
            OptimizerPlan(
                positions[number],
                record.argument,
                record.cls,
                [GroupPlan([index[n] for n in g.params], g.params, g.baked) for g in groups],
                [
                    StatePlan(
                        index[s.param],
                        s.key,
                        s.param,
                        s.shape,
                        s.dtype,
                        s.device,
                        s.strides,
                        fresh_start=fresh[s.param],
                    )
                    for s in spec.optimizer_state
                    if s.optimizer == number
                ],
                record.zero_grad_first,
            )
        )
    return OptimizerSteps(plans)


class GroupPlan:
    """One param group as captured: the model parameters it steps (flat indices ``params``,
    named ``names``), in order, and the options baked into the graph (``baked``: name and
    encoded value)."""

    def __init__(
        self, params: Sequence[int], names: Sequence[str], baked: Sequence[tuple[str, Any]]
    ) -> None:
        self.params, self.names, self.baked = list(params), list(names), list(baked)


class StatePlan(TensorPlan):
    """One state tensor the graph reads and updates: ``key`` of model parameter ``name``
    (flat index ``param``), of the shape, dtype, device and strides given; ``fresh_start``:
    None where a parameter without state may start from zero state, else why not."""

    def __init__(
        self,
        param: int,
        key: str,
        name: str,
        shape: Sequence[int],
        dtype: str,
        device: str,
        strides: Sequence[int] | None = None,
        fresh_start: str | None = None,
    ) -> None:
        super().__init__(shape, dtype, device, strides)
        self.param, self.key, self.name = param, key, name
        self.fresh_start = fresh_start


class OptimizerPlan:
    """What the optimizer argument at ``position`` (named ``name``, of class ``cls``) must be
    at every call: its param ``groups`` and state ``entries``."""

    def __init__(
        self,
        position: int,
        name: str,
        cls: str,
        groups: Sequence[GroupPlan],
        entries: Sequence[StatePlan],
        zero_grad_first: bool = False,
    ) -> None:
        self.position, self.name, self.cls = position, name, cls
        self.zero_grad_first = zero_grad_first
        self.groups, self.entries = list(groups), list(entries)
        self.keys: dict[int, int] = {}
        for entry in self.entries:
            self.keys[entry.param] = self.keys.get(entry.param, 0) + 1

    def check(self, optimizer: Any, state: Sequence[torch.Tensor]) -> tuple[Any, dict[Any, Any]]:
        """``optimizer`` checked; the zero state to give parameters that have none yet."""
        given = qualified_name(type(optimizer))
        if given != self.cls:
            raise PrecompileError(
                f"argument {self.name} was a {self.cls} at capture; got {given}. Pass an "
                "optimizer of the captured class."
            )
        self._check_step_hooks(optimizer)
        self._check_groups(optimizer, state)
        return optimizer, self._fresh_state(optimizer, state)

    def learning_rate(self, number: int, group: Any) -> torch.Tensor:
        """A param group's lr as the graph reads it: a 0-dim float64 tensor."""
        try:
            return torch.tensor(float(group["lr"]), dtype=torch.float64)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise PrecompileError(
                f"lr of param group {number} of optimizer {self.name} is "
                f"{group.get('lr')!r}; the step reads it as a number at every call. Set it to "
                "a float (or a 1-element tensor)."
            ) from e

    def _check_step_hooks(self, optimizer: Any) -> None:
        global_hooks = (_global_optimizer_pre_hooks, _global_optimizer_post_hooks)
        own = (
            getattr(optimizer, "_optimizer_step_pre_hooks", None),
            getattr(optimizer, "_optimizer_step_post_hooks", None),
        )
        if any(global_hooks) or any(own):
            raise PrecompileError(
                f"optimizer {self.name} has step hooks; an eager opt.step() would run them, "
                "and the artifact's step cannot. Remove them, or call the step outside the "
                "artifact."
            )

    def _check_groups(self, optimizer: Any, state: Sequence[torch.Tensor]) -> None:
        groups = optimizer.param_groups
        if len(groups) != len(self.groups):
            raise PrecompileError(
                f"optimizer {self.name} has {len(groups)} param groups; it had "
                f"{len(self.groups)} at capture. Build it with the same groups."
            )
        for number, (group, record) in enumerate(zip(groups, self.groups, strict=True)):
            given, params = group["params"], record.params
            if len(given) != len(params) or any(
                p is not state[i] for p, i in zip(given, params, strict=True)
            ):
                raise PrecompileError(
                    f"param group {number} of optimizer {self.name} does not step the captured "
                    f"parameters ({_listed(record.names)}, in this order) of the model "
                    "passed with it. Build the optimizer over this model's parameters, grouped "
                    "as at capture."
                )
            for option, (_, value) in record.baked:
                now = group.get(option)
                if not _same_option(now, value):
                    raise PrecompileError(
                        f"option {option!r} of param group {number} of optimizer {self.name} "
                        f"is {now!r}; it was {value!r} at capture, and only lr is read at "
                        "every call (other options are baked into the graph). Set it back, or "
                        "precompile again."
                    )
            for param, i in zip(given, params, strict=True):
                if param.grad is not None and not self.zero_grad_first:
                    raise PrecompileError(
                        f"model parameter {record.names[params.index(i)]!r} has a .grad "
                        f"from before the call; the step of optimizer {self.name} inside fn "
                        "starts from no gradient, where eager would add the old one. Call "
                        f"{self.name}.zero_grad() before the call."
                    )

    def _fresh_state(
        self, optimizer: Any, state: Sequence[torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        fresh: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for entry in self.entries:
            param = state[entry.param]
            held = optimizer.state.get(param)
            if not held or param in fresh:
                if entry.fresh_start is not None:
                    raise PrecompileError(
                        f"parameter {entry.name!r} has no state in optimizer {self.name} yet: "
                        + entry.fresh_start
                    )
                fresh.setdefault(param, {})[entry.key] = _zeros(entry, param)
                continue
            self._check_state(held, entry)
        return fresh

    def _check_state(self, held: dict[str, Any], entry: StatePlan) -> None:
        tensor = held.get(entry.key)
        what = f"state {entry.key!r} of parameter {entry.name!r} in optimizer {self.name}"
        if len(held) != self.keys[entry.param] or not isinstance(tensor, torch.Tensor):
            raise PrecompileError(
                f"optimizer {self.name} holds state {sorted(held)} for parameter "
                f"{entry.name!r}; the captured step keeps {entry.key!r} and "
                f"{self.keys[entry.param]} entries in all, as tensors. Load a state dict saved "
                "with the captured options."
            )
        check_planned(tensor, entry, what, "Load a state dict saved with the captured options.")


def _same_option(now: Any, captured: Any) -> bool:
    """Equal as the step reads them: 0 and 0.0 alike, a list like a tuple, True unlike 1."""
    if isinstance(captured, tuple):
        return (
            isinstance(now, tuple | list)
            and len(now) == len(captured)
            and all(_same_option(a, b) for a, b in zip(now, captured, strict=True))
        )
    if isinstance(captured, bool) or captured is None or isinstance(captured, str):
        return type(now) is type(captured) and now == captured
    return type(now) in (int, float) and now == captured


def _zeros(entry: StatePlan, param: torch.Tensor) -> torch.Tensor:
    if (entry.shape, entry.dtype, entry.device) == (param.shape, param.dtype, param.device):
        return torch.zeros_like(param, memory_format=torch.preserve_format)
    return torch.zeros(entry.shape, dtype=entry.dtype, device=entry.device)


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")
