"""A drop-in ``torch.optim.Optimizer`` for sharpness-aware training in users' own loops.

It shares the perturbation code with the functional methods: any ascent step (:class:`SAM`,
:class:`ASAM`, :class:`FisherSAM`) computes ``ε`` from dicts of the parameters and gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.optim.ascent import has_memory
from flatbma.optim.sam import SAM
from flatbma.types import Ascent


class SAMOptimizer(torch.optim.Optimizer):
    """Wrap a base optimizer into a two-pass sharpness-aware step.

    Usage (the davda54/sam convention)::

        opt = SAMOptimizer(model.parameters(), torch.optim.SGD, ascent=SAM(0.05), lr=0.1, momentum=0.9)
        loss_fn(model(x), y).backward(); opt.first_step(zero_grad=True)   # w ← w + ε
        disable_running_stats(model)
        loss_fn(model(x), y).backward(); opt.second_step(zero_grad=True)  # w ← w − ε, base step
        enable_running_stats(model)

    or ``opt.step(closure)`` with a closure that zeroes gradients, runs forward/backward and returns
    the loss. ``param_groups`` are shared with the base optimizer, so learning-rate schedulers and
    ``state_dict`` work as usual.

    Args:
        params: parameters or parameter groups.
        base_optimizer: the optimizer class for the descent step (e.g. ``torch.optim.SGD``).
        ascent: the ascent step (default ``SAM()``).
        **kwargs: arguments of ``base_optimizer``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        base_optimizer: type[torch.optim.Optimizer],
        ascent: Ascent | None = None,
        **kwargs: Any,
    ) -> None:
        self.ascent = ascent if ascent is not None else SAM()
        if has_memory(self.ascent):
            raise FlatbmaError(
                "SAMOptimizer takes the second pass at every step; an Amortized ascent step needs a method that "
                "keeps its memory (flatbma.posteriors.point.build(objective, optimizer, Amortized(...)))"
            )
        super().__init__(params, dict(kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        self.defaults.update(self.base_optimizer.defaults)

    def _with_grad(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        """Move to ``w + ε`` with ``ε = ascent.perturb(w, ∇L(w))``; remember ``ε``."""
        params = self._with_grad()
        if not params:
            raise FlatbmaError("first_step found no gradients: call loss.backward() before first_step()")
        keys = [str(i) for i in range(len(params))]
        eps = self.ascent.perturb(dict(zip(keys, params)), {k: p.grad for k, p in zip(keys, params)})
        for k, p in zip(keys, params):
            p.add_(eps[k])
            self.state[p]["sam_eps"] = eps[k]
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        """Return to ``w`` and take the base step with the gradient computed at ``w + ε``."""
        for group in self.param_groups:
            for p in group["params"]:
                eps = self.state[p].pop("sam_eps", None)
                if eps is not None:
                    p.sub_(eps)
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:  # type: ignore[override]
        """Full two-pass step; ``closure`` must zero gradients, compute the loss and call backward."""
        if closure is None:
            raise FlatbmaError(
                "SAMOptimizer.step needs a closure that recomputes the loss "
                "(or call first_step() and second_step() yourself)"
            )
        closure = torch.enable_grad()(closure)
        loss = closure()
        self.first_step(zero_grad=True)
        closure()
        self.second_step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state and re-share the parameter groups with the base optimizer."""
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups
        self.base_optimizer.state = self.state
