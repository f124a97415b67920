"""Flat-seeking variants find flatter posteriors than their base methods (fixed seeds, paired test).

The problem has a continuum of minimizers of different sharpness: ``L(w) = ½ (1 + w₂²) w₁²`` is zero on
the line ``w₁ = 0`` where the Hessian's top eigenvalue is ``λ₁ = 1 + w₂²``. Plain gradient methods
stop wherever they reach the valley; the SAM ascent step drifts along it towards the flattest point
``w₂ = 0`` (Wen et al. 2022), so every flat variant must end at a lower mean λ₁ of its samples.
"""

import torch
from torch import nn

from flatbma.flatness import hessian_eigenvalues
from flatbma.optim import SAM, SGD, Adam
from flatbma.params import Objective, trainable_params
from flatbma.posteriors import mfvi, point, sgld, swag

SEEDS = range(8)
DATA = [(torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1))]


class Valley(nn.Module):
    def __init__(self, w0: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w0.clone())

    def forward(self, x):
        return self.w.expand(x.shape[0], -1)


def valley_loss(out, y):
    w1, w2 = out[0, 0], out[0, 1]
    return 0.5 * (1 + w2**2) * w1**2


def _start(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [
            torch.randn((), generator=g, dtype=torch.float64) + 2.0,
            1.5 + 1.5 * torch.rand((), generator=g, dtype=torch.float64),
        ]
    )


def _mean_lambda1(build, ascent, seed, steps=600, samples=8, optimizer=None) -> float:
    torch.manual_seed(seed)
    model = Valley(_start(seed))
    objective = Objective(model=model, loss_fn=valley_loss, num_data=1)
    method = build(objective, optimizer or SGD(lr=0.05, momentum=0.0), ascent)
    state = method.init(trainable_params(model), {})
    batch = DATA[0]
    for _ in range(steps):
        state, _ = method.update(state, batch)
    draws = method.sample(state, samples, torch.Generator().manual_seed(seed))
    lam = [hessian_eigenvalues(model, DATA, 1, loss_fn=valley_loss, weights=w, max_iter=2)[0] for w in draws]
    return float(torch.stack(lam).mean())


def _assert_flatter(build, steps=600, optimizer=None, **_):
    base = [_mean_lambda1(build, None, s, steps, optimizer=optimizer) for s in SEEDS]
    flat = [_mean_lambda1(build, SAM(rho=0.3), s, steps, optimizer=optimizer) for s in SEEDS]
    # paired over seeds: the flat variant is flatter for every seed, and clearly so on average
    assert all(f < b for f, b in zip(flat, base)), (flat, base)
    assert sum(flat) / len(flat) < 0.8 * sum(base) / len(base)


def test_sam_is_flatter_than_sgd():
    _assert_flatter(point.build)


def test_f_swag_is_flatter_than_swag():
    _assert_flatter(lambda o, opt, a: swag.build(o, opt, a, rank=2, start_step=300, collect_every=10))


def test_f_mfvi_is_flatter_than_mfvi():
    _assert_flatter(lambda o, opt, a: mfvi.build(o, opt, a, init_std=1e-3, prior_std=1e3), optimizer=Adam(lr=0.02))


def test_f_sgld_is_flatter_than_sgld():
    _assert_flatter(
        lambda o, opt, a: sgld.build(
            o, opt, a, temperature=1e-4, prior_std=1e3, burn_in=300, thin=20, lr_scale="potential"
        )
    )
