"""The Laplace posterior: a MAP phase that is the point method's, a curvature pass, ``N(w*, (H/T + δ)⁻¹)``, and its
linearized predictives (MC-GLM and probit), checked against independent computations on tiny models."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp

from flatbma.bn import eval_mode
from flatbma.curvature import effective_parameters, estimator, log_evidence, optimize_prior
from flatbma.errors import FlatbmaError
from flatbma.linearized import Linearized, Probit, linearized_predictions
from flatbma.models import build_model, classifier_of
from flatbma.named import split
from flatbma.optim import SAM, SGD, Amortized
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import laplace, members, multi, point
from flatbma.predict import sample_log_probs
from flatbma.transfer import Subset, restrict_trainable, subset_names
from flatbma.types import TRAINING, Phase, Predictive, extra_epochs, phases, phases_after
from tests.helpers import tiny_bn_net, toy_batch

SECTIONS = ("params", "buffers", "aux")
MAP_STEPS, CURVATURE_STEPS = 6, 4  # 4 batches of 16: num_data = 64


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _batches():
    return [toy_batch(seed=i % CURVATURE_STEPS) for i in range(MAP_STEPS + CURVATURE_STEPS)]


def _run(method, net, steps):
    state = method.init(trainable_params(net), model_buffers(net))
    outs = []
    for batch in _batches()[:steps]:
        state, out = method.update(state, batch)
        outs.append(out)
    return state, outs


def test_laplace_declares_its_phases_and_the_state_says_which_one_it_is_in():
    assert phases(laplace.Options) == (laplace.MAP, laplace.CURVATURE) == phases(laplace.Options(start_step=3))
    assert phases_after(laplace.Options) == (Phase("curvature", epochs=1),) and extra_epochs(laplace.Options) == 1
    assert phases(point.Options) == TRAINING and phases_after(point.Options) == () and extra_epochs(point.Options) == 0
    options = laplace.Options(start_step=2)
    state = laplace.State(params={})
    assert [laplace.phase(dataclasses.replace(state, step=t), options).name for t in range(4)] == [
        "map",
        "map",
        "curvature",
        "curvature",
    ]


@pytest.mark.parametrize(
    "ascent", [None, SAM(rho=0.05), Amortized(SAM(rho=0.05), ascent_every=2)], ids=["sgd", "sam", "sam-k2"]
)
def test_the_map_phase_is_the_point_methods_run_byte_for_byte(ascent):
    runs = {}
    for name in ("point", "laplace"):
        torch.manual_seed(0)
        net = tiny_bn_net().train()
        obj = Objective(model=net, num_data=64)
        opt = SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)
        if name == "point":
            method, steps = point.build(obj, opt, ascent), MAP_STEPS
        else:
            method, steps = (
                laplace.build(obj, opt, ascent, start_step=MAP_STEPS, subset="all"),
                MAP_STEPS + CURVATURE_STEPS,
            )
        state, outs = _run(method, net, steps)
        runs[name] = (state, outs, torch.get_rng_state(), net)
    (p, p_outs, p_rng, _), (q, q_outs, q_rng, net) = runs["point"], runs["laplace"]
    assert _equal(p.params, q.params) and _equal(p.buffers, q.buffers) and torch.equal(p_rng, q_rng)
    own, _ = split(q.aux, laplace.POINT, laplace.LAPLACE)  # each component's state under its name
    assert own.keys() == p.aux.keys() and _equal(p.aux, own)
    assert all(torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits) for a, b in zip(p_outs, q_outs))
    assert q.step == MAP_STEPS + CURVATURE_STEPS and int(q.aux[laplace.SEEN]) == 64
    # the curvature phase reports the loss at w* of the deterministic (eval-mode) network
    x, y = _batches()[-1]
    with eval_mode(net), torch.no_grad():
        logits = functional_call(net, {**q.params, **q.buffers}, (x,))
    assert torch.equal(q_outs[-1].logits, logits) and torch.equal(q_outs[-1].loss, F.cross_entropy(logits, y))
    with eval_mode(net), torch.no_grad():
        nll = sum(
            F.cross_entropy(functional_call(net, {**q.params, **q.buffers}, (bx,)), by, reduction="none").double().sum()
            for bx, by in _batches()[MAP_STEPS:]
        )
    assert float(laplace.curvature_of(q).nll) == pytest.approx(float(nll), rel=1e-12)


@pytest.mark.parametrize("hessian", ["diag", "kfac", "full"])
def test_the_curvature_is_the_estimators_pass_at_the_map_and_the_posterior_its_gaussian(hessian):
    torch.manual_seed(0)
    net = tiny_bn_net().train()
    obj = Objective(model=net, num_data=64)
    method = laplace.build(obj, SGD(lr=0.1), start_step=MAP_STEPS, hessian=hessian, temperature=0.5, subset="all")
    state, _ = _run(method, net, MAP_STEPS + CURVATURE_STEPS)
    w, buffers = state.params, state.buffers
    est = estimator(hessian, "ggn", net, w, num_data=64, num_classes=3)
    acc = est.init()
    for offset, (x, y) in zip(range(0, 64, 16), _batches()[MAP_STEPS:]):
        acc = est.accumulate(acc, w, buffers, x, y, offset=offset)
    own = laplace.curvature_of(state).curvature
    assert own.keys() == acc.keys()
    for k in acc:
        torch.testing.assert_close(own[k], acc[k], rtol=1e-12, atol=0)
    # the Gaussian: δ maximizes the evidence, samples are w* + Δ with Δ = the blocks' draws, exact variances
    blocks = est.blocks(acc, 64, 64)
    delta = optimize_prior(blocks, w, 0.5, "scalar")
    g = torch.Generator().manual_seed(3)
    draws = blocks.sample(3, delta, 0.5, torch.Generator().manual_seed(3))
    samples = method.sample(state, 3, g)
    for s, d in zip(samples, draws):
        assert _equal(s, {**{k: w[k] + d[k] for k in w}, **buffers})
    assert _equal(method.marginal_variance(state), blocks.marginal_variance(delta, 0.5))
    assert _equal(method.mean(state), {**w, **buffers})
    info = method.can.diagnostics(state)
    assert info["prior_precision"] == pytest.approx(delta[blocks.names[0]], rel=1e-12)
    nll = float(laplace.curvature_of(state).nll)
    assert info["log_evidence"] == pytest.approx(log_evidence(blocks, w, nll, delta, 0.5))
    assert 0 < info["effective_params"] <= sum(v.numel() for v in w.values())
    sq = sum(float(v.double().square().sum()) for v in w.values())  # MacKay's fixed point δ‖w*‖² = γ
    assert info["prior_precision"] * sq == pytest.approx(info["effective_params"], rel=1e-6)


def test_a_fixed_prior_precision_and_layerwise_priors():
    torch.manual_seed(0)
    net = tiny_bn_net().train()
    obj = Objective(model=net, num_data=64)
    fixed = laplace.build(obj, SGD(lr=0.1), start_step=0, hessian="diag", prior_precision=7.0, subset="all")
    state, _ = _run(fixed, net, CURVATURE_STEPS)
    assert fixed.can.diagnostics(state)["prior_precision"] == 7.0
    layerwise = laplace.build(obj, SGD(lr=0.1), start_step=0, hessian="kfac", prior_structure="layerwise", subset="all")
    state, _ = _run(layerwise, net, CURVATURE_STEPS)
    info = layerwise.can.diagnostics(state)
    per_tensor = {k.split("/", 1)[1]: v for k, v in info.items() if k.startswith("prior_precision/")}
    assert per_tensor.keys() == state.params.keys() and len(set(per_tensor.values())) > 1
    assert info["prior_precision"] == pytest.approx(math.exp(sum(map(math.log, per_tensor.values())) / len(per_tensor)))


def test_post_hoc_laplace_leaves_the_given_weights_and_memoizes_its_fit(monkeypatch):
    torch.manual_seed(0)
    net = tiny_bn_net().train()
    params = trainable_params(net)
    method = laplace.build(Objective(model=net, num_data=64), SGD(lr=0.1), start_step=0, hessian="diag", subset="all")
    with pytest.raises(FlatbmaError, match="no curvature was accumulated yet"):
        method.sample(method.init(params, model_buffers(net)), 2, None)
    state, _ = _run(method, net, CURVATURE_STEPS)
    assert _equal(state.params, params)
    solves = []
    real = laplace.optimize_prior
    monkeypatch.setattr(laplace, "optimize_prior", lambda *a: solves.append(1) or real(*a))
    first = method.sample(state, 2, torch.Generator().manual_seed(0))
    method.marginal_variance(state), method.can.diagnostics(state)
    again = method.sample(state, 2, torch.Generator().manual_seed(0))
    assert len(solves) == 1 and all(map(_equal, first, again))  # one eigendecomposition and δ per state
    state, _ = method.update(state, toy_batch(seed=9))  # accumulates in place: a new fit
    method.sample(state, 2, torch.Generator().manual_seed(0))
    assert len(solves) == 2


def test_multi_of_one_laplace_member_is_laplace_bit_for_bit():
    runs = []
    for wrap in (False, True):
        torch.manual_seed(0)
        net = tiny_bn_net().train()
        obj = Objective(model=net, num_data=64)
        base = laplace.build(
            obj, SGD(lr=0.1, momentum=0.9), SAM(rho=0.05), start_step=MAP_STEPS, hessian="kfac", subset="all"
        )
        method = multi.build(obj, base, members=1, seed=4) if wrap else base
        state, _ = _run(method, net, MAP_STEPS + CURVATURE_STEPS)
        runs.append((method, state, members.member_state(0, state) if wrap else state))
    (base, sa, a), (wrapped, sb, b) = runs
    for section in SECTIONS:
        assert _equal(getattr(a, section), getattr(b, section)), section
    assert wrapped.can.predictive is base.can.predictive is Predictive.GLM
    assert all(
        map(
            _equal,
            base.sample(sa, 3, torch.Generator().manual_seed(1)),
            wrapped.sample(sb, 3, torch.Generator().manual_seed(1)),
        )
    )
    assert base.can.diagnostics(sa) == wrapped.can.diagnostics(sb)
    jac = {k: torch.randn(5, 3, *v.shape) for k, v in a.params.items()}
    assert torch.equal(base.can.functional_variance(sa, jac), wrapped.can.functional_variance(sb, jac))
    with pytest.raises(FlatbmaError, match=r"set method\.of\.predictive: samples, or method\.members: 1"):
        multi.build(Objective(model=tiny_bn_net()), base, members=3)


# --------------------------------------------------------------------------------------------------
# the prior mean: zero, or the pretrained weights (L2-SP)


def _pretrained_cnn(tmp_path, trainable=Subset.NORM_CLASSIFIER):
    """A 4-class cnn loaded from a 10-class checkpoint (its head re-drawn); the checkpoint's tensors."""
    source = build_model("cnn", num_classes=10, in_channels=1, image_size=8, width=4, seed=1)
    with torch.no_grad():
        for t in source.parameters():
            t.add_(0.5)  # pretrained values unlike any fresh initialization (BatchNorm weight 1.5, ...)
    torch.save(source.state_dict(), tmp_path / "pretrained.pt")
    net = build_model("cnn", num_classes=4, in_channels=1, image_size=8, width=4, pretrained=tmp_path / "pretrained.pt")
    restrict_trainable(net, subset_names(net, trainable))
    return net.train(), source.state_dict()


def _image_batches(steps):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


def test_a_pretrained_prior_mean_is_stored_and_enters_only_the_evidence_and_delta(tmp_path):
    """``w₀`` = the pretrained values of the loaded tensors, 0 for the re-drawn head; ``δ‖w* − w₀‖² = γ``; the
    MAP, the curvature and (at a fixed δ) the samples are those of ``prior_mean: zero``."""
    runs = {}
    for prior_mean in ("zero", "pretrained"):
        for precision in (None, 3.0):
            torch.manual_seed(0)
            net, checkpoint = _pretrained_cnn(tmp_path)
            obj = Objective(model=net, num_data=16)
            method = laplace.build(
                obj,
                SGD(lr=0.1),
                start_step=2,
                hessian="diag",
                prior_mean=prior_mean,
                prior_precision=precision,
                subset="all",
            )
            state = method.init(trainable_params(net), model_buffers(net))
            for batch in _image_batches(4):
                state, _ = method.update(state, batch)
            runs[prior_mean, precision] = (method, state)
    head = classifier_of(net)[0] + "."
    _, zero = runs["zero", None]
    method, state = runs["pretrained", None]
    assert not laplace.curvature_of(zero).prior_mean  # zero: the state as before
    w0 = laplace.curvature_of(state).prior_mean
    assert w0.keys() == state.params.keys() and any(k.startswith(head) for k in w0)
    for k, v in w0.items():
        expected = torch.zeros_like(v) if k.startswith(head) else checkpoint[k]
        assert v.dtype == state.params[k].dtype and torch.equal(v, expected), k
    assert not torch.equal(state.params[next(iter(w0))], w0[next(iter(w0))])  # w* moved away from w₀
    for section in ("params", "buffers"):
        assert _equal(getattr(state, section), getattr(zero, section)), section
    assert _equal({k: v for k, v in state.aux.items() if not k.startswith("laplace/prior_mean/")}, zero.aux)
    info = method.can.diagnostics(state)
    w, delta = state.params, info["prior_precision"]
    sq = sum(float((w[k].double() - w0[k].double()).square().sum()) for k in w)
    assert delta * sq == pytest.approx(info["effective_params"], rel=1e-8)  # MacKay's fixed point around w₀
    est = estimator("diag", "ggn", net, w, num_data=16, num_classes=4)
    blocks = est.blocks(laplace.curvature_of(zero).curvature, 16, 16)
    nll = float(laplace.curvature_of(state).nll)
    assert info["log_evidence"] == pytest.approx(log_evidence(blocks, w, nll, delta, 1.0, w0), rel=1e-12)
    assert info["effective_params"] == pytest.approx(effective_parameters(blocks, delta, 1.0), rel=1e-12)
    assert delta != pytest.approx(runs["zero", None][0].can.diagnostics(zero)["prior_precision"], rel=1e-2)
    assert _equal(method.mean(state), runs["zero", None][0].mean(zero))  # post hoc: the mean stays w*
    (fz, sz), (fp, sp) = runs["zero", 3.0], runs["pretrained", 3.0]
    draws = [m.sample(st, 2, torch.Generator().manual_seed(5)) for m, st in ((fz, sz), (fp, sp))]
    assert all(map(_equal, *draws))  # a fixed δ: the same posterior, only the evidence differs
    assert fz.can.diagnostics(sz)["log_evidence"] != fp.can.diagnostics(sp)["log_evidence"]


def test_a_pretrained_prior_mean_needs_a_trained_tensor_loaded_from_a_checkpoint(tmp_path):
    with pytest.raises(FlatbmaError, match=r"method\.prior_mean must be one of") as err:
        laplace.build(Objective(model=tiny_bn_net()), SGD(lr=0.1), prior_mean="init", subset="all")
    assert "\n" not in str(err.value)
    net, _ = _pretrained_cnn(tmp_path, Subset.CLASSIFIER)  # only the re-drawn head is trained: nothing pretrained
    for model in (tiny_bn_net(), net):
        method = laplace.build(Objective(model=model), SGD(lr=0.1), prior_mean="pretrained", subset="all")
        with pytest.raises(FlatbmaError, match="nothing is pretrained") as err:
            method.init(trainable_params(model), model_buffers(model))
        assert "\n" not in str(err.value) and "prior_mean: zero" in str(err.value)


# --------------------------------------------------------------------------------------------------
# the linearized predictives (float64)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4))

    def forward(self, x):
        return self.body(x)


def _posterior(net, hessian="diag", predictive="glm"):
    """Post-hoc Laplace of ``net`` (float64) after one pass over 3 batches."""
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(10, 5, generator=g, dtype=torch.float64), torch.randint(0, 4, (10,), generator=g))
        for _ in range(3)
    ]
    method = laplace.build(
        Objective(model=net, num_data=30),
        SGD(lr=0.1),
        start_step=0,
        hessian=hessian,
        predictive=predictive,
        subset="all",
    )
    state = method.init(trainable_params(net), model_buffers(net))
    for batch in data:
        state, _ = method.update(state, batch)
    return method, state


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's jvp decompositions
def test_mc_glm_logits_are_the_networks_value_plus_its_jvp_along_each_sample():
    torch.manual_seed(0)
    net = _Mlp().double()
    method, state = _posterior(net, "kfac")
    samples = method.sample(state, 4, torch.Generator().manual_seed(1))
    mean = method.mean(state)
    glm = linearized_predictions("glm", mean, samples, list(state.params))
    x = torch.randn(6, 5, dtype=torch.float64)
    got = sample_log_probs(net, glm, x)
    w = dict(state.params)
    for m, sample in enumerate(samples):
        delta = {k: sample[k] - w[k] for k in w}
        value, tangent = jvp(lambda p: functional_call(net, p, (x,)), (w,), (delta,))
        torch.testing.assert_close(got[m], F.log_softmax(value + tangent, -1), rtol=1e-12, atol=1e-12)
    assert len(glm) == 4 and len(glm[:2]) == 2 and isinstance(glm[:2], Linearized)


def test_glm_equals_the_samples_for_a_model_linear_in_its_parameters():
    torch.manual_seed(0)
    net = nn.Linear(5, 4).double()  # softmax regression: f(x; w) is linear in w
    method, state = _posterior(net, "full")
    samples = method.sample(state, 5, torch.Generator().manual_seed(2))
    glm = linearized_predictions("glm", method.mean(state), samples, list(state.params))
    x = torch.randn(8, 5, dtype=torch.float64)
    torch.testing.assert_close(sample_log_probs(net, glm, x), sample_log_probs(net, samples, x), rtol=1e-12, atol=1e-12)


def test_probit_is_the_softmax_of_the_logits_scaled_by_their_variance():
    torch.manual_seed(0)
    net = nn.Linear(5, 4).double()
    method, state = _posterior(net, "diag", "probit")
    variance = method.marginal_variance(state)
    x = torch.randn(6, 5, dtype=torch.float64)
    # by hand: f_c = W_c·x + b_c with independent weights, so Var f_c = Σ_j x_j² Var W_cj + Var b_c
    sigma2 = (x**2) @ variance["weight"].T + variance["bias"]
    logits = net(x)
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * sigma2)
    probit = linearized_predictions(
        "probit", method.mean(state), [], list(state.params), lambda j: method.can.functional_variance(state, j)
    )
    assert isinstance(probit, Probit) and len(probit) == 1 and probit[:5] is probit
    torch.testing.assert_close(
        sample_log_probs(net, probit, x)[0], F.log_softmax(kappa * logits, -1), rtol=1e-12, atol=1e-12
    )


# --------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prior_precision": -1.0}, "method.prior_precision must be a positive number"),
        ({"prior_precision": float("nan")}, "method.prior_precision must be a positive number"),
        ({"temperature": 0}, "method.temperature must be a positive number"),
        ({"start_step": -2}, "method.start_step must be an integer >= 0"),
        ({"max_full": 0}, "method.max_full must be a positive integer"),
        ({"hessian": "kron"}, "method.hessian must be one of"),
        ({"predictive": "nn"}, "method.predictive must be one of"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(FlatbmaError, match=message) as err:
        laplace.build(Objective(model=tiny_bn_net()), SGD(lr=0.1), **{"subset": "all", **options})
    assert "\n" not in str(err.value)


def test_what_laplace_cannot_take_is_refused_before_it_trains():
    net = tiny_bn_net()
    with pytest.raises(FlatbmaError, match="Gauss-Newton of the cross-entropy"):
        laplace.build(Objective(model=net, loss_fn=F.nll_loss), SGD(lr=0.1), subset="all")
    method = laplace.build(Objective(model=net), SGD(lr=0.1), subset="all")
    state = method.init(trainable_params(net), model_buffers(net))
    with pytest.raises(FlatbmaError, match="give start_step"):
        method.update(state, toy_batch())
    layerwise = laplace.build(
        Objective(model=net), SGD(lr=0.1), hessian="full", prior_structure="layerwise", subset="all"
    )
    with pytest.raises(FlatbmaError, match="layerwise needs a curvature that is block-diagonal"):
        layerwise.init(trainable_params(net), model_buffers(net))
    dual = laplace.build(
        Objective(model=net, num_data=2, reduce_grads=dict), SGD(lr=0.1), hessian="full", max_full=10, subset="all"
    )
    with pytest.raises(FlatbmaError, match=r"cannot run under train\.parallel: data"):
        dual.init(trainable_params(net), model_buffers(net))
    big = laplace.build(Objective(model=net, num_data=1000), SGD(lr=0.1), hessian="full", max_full=10, subset="all")
    with pytest.raises(FlatbmaError, match="hessian: full needs d"):
        big.init(trainable_params(net), model_buffers(net))
    no_linear = laplace.build(
        Objective(model=nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())), SGD(lr=0.1), subset="all"
    )
    with pytest.raises(FlatbmaError, match=r"has no nn\.Linear"):
        no_linear.init(*(dict(nn.Conv2d(1, 2, 3).named_parameters(prefix="0")), {}))
    with pytest.raises(FlatbmaError, match="not linearized"):
        linearized_predictions(Predictive.SAMPLES, {}, [], [])
