import math

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.optim import ASAM, SAM, SGD, FisherSAM, cosine
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import point
from tests.helpers import quadratic_objective, tiny_bn_net, toy_batch

W = {"a": torch.tensor([1.0, -2.0])}
G = {"a": torch.tensor([3.0, 4.0])}


def test_sam_perturbation_is_rho_times_unit_gradient():
    eps = SAM(rho=0.5).perturb(W, G)["a"]
    torch.testing.assert_close(eps, torch.tensor([0.3, 0.4]))


def test_asam_perturbation_matches_hand_computation():
    # T = |w| = [1, 2]; T g = [3, 8]; ε = ρ T² g / ‖T g‖ = ρ [3, 16] / √73
    eps = ASAM(rho=0.5, eta=0.0).perturb(W, G)["a"]
    torch.testing.assert_close(eps, 0.5 * torch.tensor([3.0, 16.0]) / math.sqrt(73))
    # with η: T = |w| + η
    eta = 0.1
    t = torch.tensor([1.1, 2.1])
    expected = 0.5 * t * t * G["a"] / torch.linalg.norm(t * G["a"])
    torch.testing.assert_close(ASAM(rho=0.5, eta=eta).perturb(W, G)["a"], expected)


def test_fisher_sam_perturbation_matches_hand_computation():
    # F = 1 + g² = [10, 17]; F⁻¹g = [0.3, 4/17]; gᵀF⁻¹g = 0.9 + 16/17
    rho = 0.2
    eps = FisherSAM(rho=rho, eta=1.0).perturb(W, G)["a"]
    fg = torch.tensor([0.3, 4 / 17])
    torch.testing.assert_close(eps, rho * fg / math.sqrt(0.9 + 16 / 17))
    # ε lies on the Fisher sphere: εᵀ F ε = ρ²
    F = torch.tensor([10.0, 17.0])
    torch.testing.assert_close((eps * F * eps).sum(), torch.tensor(rho**2))


def test_fisher_sam_with_zero_eta_is_sam():
    torch.testing.assert_close(FisherSAM(rho=0.3, eta=0.0).perturb(W, G)["a"], SAM(rho=0.3).perturb(W, G)["a"])


def test_zero_gradient_gives_zero_perturbation():
    zero = {"a": torch.zeros(2)}
    for ascent in (SAM(), ASAM(), FisherSAM()):
        assert torch.equal(ascent.perturb(W, zero)["a"], torch.zeros(2))


@pytest.mark.parametrize("cls", [SAM, ASAM, FisherSAM])
@pytest.mark.parametrize("rho", [0.0, -1.0, float("nan")])
def test_bad_radius_is_a_clear_error(cls, rho):
    with pytest.raises(FlatbmaError, match="rho must be a positive number"):
        cls(rho=rho)


def test_sam_update_uses_gradient_at_perturbed_point():
    A = torch.diag(torch.tensor([4.0, 1.0]))
    c = torch.tensor([1.0, -1.0])
    w0 = torch.tensor([2.0, 3.0])
    obj = quadratic_objective(A, c, w0)
    lr, rho = 0.1, 0.05
    method = point.build(obj, SGD(lr=lr, momentum=0.0), SAM(rho=rho))
    state = method.init(trainable_params(obj.model), {})
    state, out = method.update(state, (torch.zeros(1, 1), torch.zeros(1)))
    g = A @ (w0 - c)
    eps = rho * g / g.norm()
    expected = w0 - lr * (A @ (w0 + eps - c))
    torch.testing.assert_close(state.params["w"], expected)
    torch.testing.assert_close(out.loss, 0.5 * (w0 - c) @ A @ (w0 - c))


@pytest.mark.parametrize("ascent", [SAM(rho=0.05), ASAM(rho=0.2, eta=0.01), FisherSAM(rho=0.05)])
def test_sharpness_aware_point_converges_to_quadratic_minimum(ascent):
    A = torch.diag(torch.tensor([10.0, 3.0, 0.5]))
    c = torch.tensor([1.0, -2.0, 0.5])
    obj = quadratic_objective(A, c, torch.zeros(3))
    steps = 400
    method = point.build(obj, SGD(lr=cosine(0.08, steps), momentum=0.0), ascent)
    state = method.init(trainable_params(obj.model), {})
    batch = (torch.zeros(1, 1), torch.zeros(1))
    for _ in range(steps):
        state, _ = method.update(state, batch)
    assert torch.linalg.norm(state.params["w"] - c) < 1e-2


def test_batchnorm_statistics_are_updated_once_per_sam_step():
    torch.manual_seed(0)
    net = tiny_bn_net()
    obj = Objective(model=net)
    net.train()
    batch = toy_batch()
    method = point.build(obj, SGD(lr=0.1), SAM(rho=0.5))
    state = method.init(trainable_params(net), model_buffers(net))
    # reference: one forward pass at w in train mode
    ref = tiny_bn_net()
    ref.load_state_dict(net.state_dict())
    ref.train()
    ref(batch[0])
    state, _ = method.update(state, batch)
    assert int(state.buffers["1.num_batches_tracked"]) == 1
    torch.testing.assert_close(state.buffers["1.running_mean"], ref[1].running_mean)
    torch.testing.assert_close(state.buffers["1.running_var"], ref[1].running_var)
    # the template module itself is untouched
    assert int(net[1].num_batches_tracked) == 0
