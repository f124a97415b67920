"""Amortized ascent steps: LookSAM's reuse against its closed form, the dual-metric split, the batch fraction."""

import math

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.optim import ASAM, SAM, Amortized, FisherBall, FisherSAM, Reuse, SAMOptimizer
from flatbma.optim.amortized import ORTHOGONAL, POSITION, SCALE
from flatbma.optim.ascent import sharpness_aware_value_and_grad, two_pass
from flatbma.params import Objective, clone, model_buffers, trainable_params

A = torch.tensor([[3.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 0.1]], dtype=torch.float64)
B = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
"""The quadratic ``L(w) = ½wᵀAw − bᵀw`` on ``w = (u, v)``, ``u ∈ R²``, ``v ∈ R``: ``∇L = Aw − b``."""


def _split(w):
    return {"u": w[:2].clone(), "v": w[2:].clone()}


def _flat(d):
    return torch.cat([d["u"].reshape(-1), d["v"].reshape(-1)])


def quadratic_gradient(point, batch, first):
    """``gradient(point, batch, first)`` of :func:`two_pass` for the quadratic (the batch is unused)."""
    w = _flat(point)
    return 0.5 * w @ A @ w - B @ w, torch.zeros(()), _split(A @ w - B)


def test_reused_gradient_is_looksams_formula_on_a_quadratic():
    rho, alpha = 0.3, 0.7
    step = Amortized(SAM(rho), ascent_every=3, reuse="orthogonal", reuse_alpha=alpha)
    w0 = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    memory = step.init(_split(w0))
    # step 0 of the cycle: both passes; LookSAM's g_v in closed form (Liu et al. 2022, Algorithm 1)
    _, _, got = two_pass(quadratic_gradient, _split(w0), None, step, memory)
    g = A @ w0 - B
    g_s = A @ (w0 + rho * g / g.norm()) - B
    g_v = g_s - (g @ g_s) / (g @ g) * g
    torch.testing.assert_close(_flat(got), g_s, rtol=1e-12, atol=0)
    torch.testing.assert_close(_flat({k: memory[ORTHOGONAL + k] for k in "uv"}), g_v, rtol=1e-12, atol=1e-14)
    assert int(memory[POSITION]) == 1
    # steps 1 and 2: one pass, g̃ = g + α (‖g‖/‖g_v‖) g_v at the new points
    for w in (torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64), torch.tensor([0.2, -0.3, 4.0], dtype=torch.float64)):
        _, _, got = two_pass(quadratic_gradient, _split(w), None, step, memory)
        g = A @ w - B
        torch.testing.assert_close(_flat(got), g + alpha * g.norm() / g_v.norm() * g_v, rtol=1e-10, atol=0)
    assert int(memory[POSITION]) == 0  # the next step takes both passes again
    w = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    _, _, got = two_pass(quadratic_gradient, _split(w), None, step, memory)
    g = A @ w - B
    torch.testing.assert_close(_flat(got), A @ (w + rho * g / g.norm()) - B, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("ascent", "metric_inverse"),
    [
        (ASAM(rho=0.4, eta=0.01), lambda w, g: (w.abs() + 0.01) ** 2),  # M⁻¹ = T_w²
        (FisherSAM(rho=0.2, eta=2.0), lambda w, g: 1 / (1 + 2.0 * g * g)),  # M⁻¹ = (1 + ηg²)⁻¹ of that gradient
    ],
)
def test_split_and_ratio_are_in_the_ascent_steps_dual_metric(ascent, metric_inverse):
    """g_v is M⁻¹-orthogonal to g₀ (εᵀg_v = 0); the ratio is ‖g₀‖_*/‖g_v‖_* (‖a‖_* = √(aᵀM⁻¹a)) times ‖g‖/‖g₀‖."""
    step = Amortized(ascent, ascent_every=2, reuse_alpha=0.5)
    w0 = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    memory = step.init(_split(w0))
    two_pass(quadratic_gradient, _split(w0), None, step, memory)
    g = A @ w0 - B
    g_v = _flat({k: memory[ORTHOGONAL + k] for k in "uv"})
    assert abs(float((metric_inverse(w0, g) * g) @ g_v)) < 1e-12 * float(g.norm() * g_v.norm())
    dual_v = math.sqrt(float(g_v @ (metric_inverse(w0, g_v) * g_v)))
    dual_0 = math.sqrt(float(g @ (metric_inverse(w0, g) * g)))
    assert float(memory[SCALE]) == pytest.approx(dual_0 / (float(g.norm()) * dual_v), rel=1e-9)
    w1 = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    _, _, got = two_pass(quadratic_gradient, _split(w1), None, step, memory)
    g1 = A @ w1 - B
    want = g1 + 0.5 * float(g1.norm() / g.norm()) * dual_0 / dual_v * g_v
    torch.testing.assert_close(_flat(got), want, rtol=1e-9, atol=0)


def test_reuse_none_descends_along_the_plain_gradient_and_keeps_no_direction():
    step = Amortized(SAM(0.1), ascent_every=2, reuse=Reuse.NONE)
    w = _split(torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64))
    memory = step.init(w)
    assert set(memory) == {POSITION}
    two_pass(quadratic_gradient, w, None, step, memory)
    _, _, got = two_pass(quadratic_gradient, w, None, step, memory)
    torch.testing.assert_close(_flat(got), A @ _flat(w) - B, rtol=0, atol=0)


def _net():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).train()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(10, 5, generator=g), torch.randint(0, 3, (10,), generator=g))
    return Objective(model=model), batch


@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_batch_fraction_takes_the_second_pass_on_the_first_examples(fraction):
    objective, (x, y) = _net()
    params, buffers = trainable_params(objective.model), model_buffers(objective.model)
    step = Amortized(SAM(0.05), ascent_fraction=fraction)
    before = clone(buffers)
    _, _, got = sharpness_aware_value_and_grad(objective, params, buffers, (x, y), step, step.init(params))
    # independently: ε from the whole batch's gradient, the gradient at w + ε on the first ⌈f·B⌉ examples
    n = {0.5: 5, 0.3: 3}[fraction]
    _, _, g = objective.value_and_grad(params, clone(before), (x, y))
    eps = SAM(0.05).perturb(params, g)
    moved = {k: params[k] + eps[k] for k in params}
    _, _, want = objective.value_and_grad(moved, clone(before), (x[:n], y[:n]), update_buffers=False)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_fraction_one_and_every_step_is_the_wrapped_step_bit_for_bit():
    objective, batch = _net()
    params, buffers = trainable_params(objective.model), model_buffers(objective.model)
    step = Amortized(SAM(0.05), ascent_every=1, ascent_fraction=1.0)
    _, _, got = sharpness_aware_value_and_grad(objective, params, clone(buffers), batch, step, step.init(params))
    _, _, want = sharpness_aware_value_and_grad(objective, params, clone(buffers), batch, SAM(0.05))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ascent_every": 0}, "ascent_every must be an integer >= 1"),
        ({"ascent_every": 2.5}, "ascent_every must be an integer >= 1"),
        ({"ascent_fraction": 0.0}, "ascent_fraction must be a number in (0, 1]"),
        ({"ascent_fraction": 1.5}, "ascent_fraction must be a number in (0, 1]"),
        ({"reuse": "lookahead"}, "reuse must be one of 'orthogonal', 'none'"),
        ({"reuse_alpha": -1.0}, "reuse_alpha must be a number >= 0"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, message):
    with pytest.raises(FlatbmaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Amortized(SAM(), **kwargs)


def test_it_needs_a_plain_ascent_step_and_a_memory():
    with pytest.raises(FlatbmaError, match="needs an ascent step"):
        Amortized(None)
    with pytest.raises(FlatbmaError, match="not another Amortized"):
        Amortized(Amortized(SAM()))
    objective, batch = _net()
    params = trainable_params(objective.model)
    with pytest.raises(FlatbmaError, match="keeps a memory"):
        sharpness_aware_value_and_grad(objective, params, model_buffers(objective.model), batch, Amortized(SAM()))
    with pytest.raises(FlatbmaError, match="second pass at every step"):
        SAMOptimizer(objective.model.parameters(), torch.optim.SGD, ascent=Amortized(SAM()), lr=0.1)


def test_it_acts_where_the_wrapped_step_acts():
    assert Amortized(SAM()).space is SAM.space
    assert Amortized(FisherBall()).space is FisherBall.space
    w = _split(torch.tensor([1.0, 2.0, -1.0]))
    g = _split(torch.tensor([0.3, -0.1, 2.0]))
    assert all(torch.equal(Amortized(ASAM()).perturb(w, g)[k], ASAM().perturb(w, g)[k]) for k in w)
