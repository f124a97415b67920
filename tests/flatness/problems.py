"""Small problems with dense reference Hessians for the flatness tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from flatbma.bn import eval_mode
from flatbma.params import flatten, unflatten
from tests.helpers import Quadratic


@dataclass
class Problem:
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    batches: list  # unequal sizes 7, 13, 20

    def dense_hessian(self, names=None, weights=None, loss_fn=F.cross_entropy) -> torch.Tensor:
        """Full Hessian of the mean loss over all data, by torch.autograd.functional.hessian."""
        weights = dict(weights or {})
        params = {
            k: weights.get(k, v).detach() for k, v in self.model.named_parameters() if names is None or k in names
        }
        fixed = {k: v for k, v in weights.items() if k not in params}

        def loss(flat):
            p = unflatten(flat, params)
            return loss_fn(functional_call(self.model, {**fixed, **p}, (self.x,)), self.y)

        with eval_mode(self.model):
            return torch.autograd.functional.hessian(loss, flatten(params))


def make_problem(dtype=torch.float64) -> Problem:
    """An MLP with BatchNorm (203 + 16 parameters) in *train* mode, with non-trivial running stats."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)
    ).to(dtype)
    with torch.no_grad():
        model[3].running_mean.uniform_(-0.5, 0.5)
        model[3].running_var.uniform_(0.5, 2.0)
        model[3].weight.uniform_(0.5, 1.5)
    model.train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 5, generator=g).to(dtype) * 2
    y = torch.randint(0, 3, (40,), generator=g)
    batches = [(x[:7], y[:7]), (x[7:20], y[7:20]), (x[20:], y[20:])]
    return Problem(model, x, y, batches)


def quadratic_problem(eigenvalues, seed: int = 0, dtype=torch.float64):
    """``L(w) = ½ wᵀ A w`` with ``A = Q diag(λ) Qᵀ``: a model, a loss and one batch."""
    lam = torch.as_tensor(eigenvalues, dtype=torch.float64)
    d = lam.numel()
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    a = ((q * lam) @ q.T).to(dtype)
    model = Quadratic(torch.randn(d, generator=g, dtype=torch.float64).to(dtype))

    def loss_fn(out, y):
        w = out[0]
        return 0.5 * w @ a @ w

    batch = (torch.zeros(3, 1, dtype=dtype), torch.zeros(3, dtype=torch.long))
    return model, loss_fn, batch, a
