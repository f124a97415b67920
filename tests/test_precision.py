"""Mixed precision (``train.precision``): every method under bf16 autocast, fp16's loss scale and its skipped steps.

CPU autocast runs bf16 and fp16 here; the CUDA counterparts are in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.config.sections import TrainConfig
from flatbma.loop import fit
from flatbma.methods import METHODS, parse_method
from flatbma.optim import SGD, FisherBall, LossScaled
from flatbma.optim.loss_scale import GROWTH, SCALE
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import lowrank_vi, point
from flatbma.precision import Precision, autocast
from tests.helpers import relative_difference, tiny_bn_net, toy_batch, train_steps

BF16_TOLERANCE = 0.1
"""Largest relative difference ``‖s_bf16 − s_fp32‖ / ‖s_fp32 − s_0‖`` of the trained variables after 3 steps:
how far bf16's forward passes move the trajectory, relative to how far training moved it. Measured on the
toy problem below (torch 2.13, CPU): at most 0.011 for every registered method but ``fsam``, 0.056 there
(Fisher-SAM's metric ``1 + η g⊙g`` squares the gradient's bf16 error); the SG-MCMC and VI methods draw the
same noise in both runs, so only the forward precision differs."""


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_trains_under_bf16_within_tolerance_of_fp32(name):
    start, full, _ = train_steps(name)
    _, half, _ = train_steps(name, precision="bf16")
    assert set(half.params) == set(full.params)
    assert all(v.dtype == full.params[k].dtype for k, v in half.params.items())  # variables stay float32
    assert relative_difference(half.params, full.params, start) < BF16_TOLERANCE


@pytest.mark.parametrize("name", ["sgd", "sam", "fp-bma", "swag", "ensemble", "multi", "sgld", "ivon"])
def test_fp16_loss_scale_trains_every_kind_of_state(name):
    start, full, _ = train_steps(name)
    _, half, method = train_steps(name, precision="fp16", wrap=LossScaled())
    assert float(half.aux[SCALE]) == 2.0**16 and int(half.aux[GROWTH]) == 3  # no overflow on this problem
    assert relative_difference(half.params, full.params, start) < BF16_TOLERANCE
    assert method.sample(half, 2, torch.Generator().manual_seed(0))


def _overflow_once(monkeypatch, at_call: int) -> list[int]:
    """Make the ``at_call``-th gradient evaluation (0-based) return an inf gradient entry; returns the call counter."""
    import flatbma.params as params_module

    real = params_module.value_and_grad
    calls = [0]

    def value_and_grad(fn, params):
        loss, aux, grads = real(fn, params)
        if calls[0] == at_call:
            key = next(iter(grads))
            grads[key] = grads[key].clone()
            grads[key].view(-1)[0] = float("inf")
        calls[0] += 1
        return loss, aux, grads

    monkeypatch.setattr(params_module, "value_and_grad", value_and_grad)
    return calls


@pytest.mark.parametrize("name", ["sam", "fp-bma", "sgd"])
def test_an_fp16_overflow_skips_the_ascent_and_the_update_and_is_recorded(monkeypatch, name):
    torch.manual_seed(0)
    model = tiny_bn_net()
    objective = Objective(model=model, num_data=64, precision=Precision.FP16)
    method = LossScaled(init_scale=1024.0, growth_interval=2)(parse_method(name).build(objective, SGD(lr=0.1)))
    state = method.init(trainable_params(model), model_buffers(model))
    batch = toy_batch()
    state, out = method.update(state, batch)  # a normal step: one or two passes
    passes = 1 if name == "sgd" else 2
    assert float(out.stats["amp/skipped"]) == 0 and float(out.stats["amp/scale"]) == 1024
    before = dataclasses.replace(state, params={k: v.clone() for k, v in state.params.items()})
    aux_before = {k: v.clone() for k, v in state.aux.items()}
    buffers_before = {k: v.clone() for k, v in state.buffers.items()}
    calls = _overflow_once(monkeypatch, at_call=0)  # the first pass overflows
    state, out = method.update(state, batch)
    assert calls[0] == 1  # the ascent's second pass never ran
    assert torch.isfinite(out.loss) and float(out.stats["amp/skipped"]) == 1 and float(out.stats["amp/scale"]) == 1024
    assert state.step == before.step + 1
    assert all(torch.equal(state.params[k], before.params[k]) for k in before.params)  # no update
    assert all(torch.equal(state.buffers[k], buffers_before[k]) for k in buffers_before)  # nor BatchNorm statistics
    assert float(state.aux[SCALE]) == 512 and int(state.aux[GROWTH]) == 0
    assert all(torch.equal(state.aux[k], aux_before[k]) for k in aux_before if k not in (SCALE, GROWTH))
    if passes == 2:  # an overflow in the second pass skips the update too
        calls = _overflow_once(monkeypatch, at_call=1)
        kept = {k: v.clone() for k, v in state.params.items()}
        if name == "sam":  # the skipped step reports its first, unperturbed pass
            unperturbed = objective.loss(state.params, {k: v.clone() for k, v in state.buffers.items()}, batch)[0]
        state, out = method.update(state, batch)
        assert calls[0] == 2 and float(out.stats["amp/skipped"]) == 1
        if name == "sam":
            assert torch.equal(out.loss, unperturbed.detach())
        assert all(torch.equal(state.params[k], kept[k]) for k in kept)
        assert float(state.aux[SCALE]) == 256
    monkeypatch.undo()
    for _ in range(2):  # growth_interval finite steps double the scale
        scale = float(state.aux[SCALE])
        state, out = method.update(state, batch)
    assert float(state.aux[SCALE]) == 2 * scale and float(out.stats["amp/skipped"]) == 0


def test_the_loop_logs_the_fraction_of_skipped_steps(monkeypatch):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = tiny_bn_net()
    objective = Objective(model=model, num_data=64, precision=Precision.FP16)
    method = LossScaled()(point.build(objective, SGD(lr=0.1)))
    x, y = toy_batch(n=64)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    _overflow_once(monkeypatch, at_call=1)
    state, history = fit(method, method.init(trainable_params(model), model_buffers(model)), loader, epochs=1)
    stats = history.epochs[0].stats
    assert stats["amp/skipped"] == 0.25 and state.step == 4
    assert history.epochs[0].steps == 4 and float(state.aux[SCALE]) == 2.0**15


def test_fp32_enters_no_autocast_and_bf16_only_the_forward_pass():
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, x):
            seen.setdefault("forward", []).append(torch.is_autocast_enabled("cpu"))
            return self.lin(x)

    class Recording(FisherBall):
        def perturb(self, params, grads):
            seen.setdefault("ascent", []).append(torch.is_autocast_enabled("cpu"))
            return super().perturb(params, grads)

    for precision, expected in (("fp32", False), ("bf16", True)):
        seen.clear()
        model = Probe()
        objective = Objective(model=model, num_data=16, precision=precision)
        method = lowrank_vi.build(objective, SGD(lr=0.1), Recording(), rank=2)
        state = method.init(trainable_params(model), {})
        _, out = method.update(state, toy_batch())
        assert out.logits.dtype == torch.float32 and out.loss.dtype == torch.float32
        assert set(seen["forward"]) == {expected}  # the model's forward passes alone
        assert seen["ascent"] == [False]  # the Fisher solve and the Gaussian's closed forms: never under autocast


def test_autocast_is_no_context_at_fp32():
    import contextlib

    assert isinstance(autocast("fp32", "cpu"), contextlib.nullcontext)
    assert isinstance(autocast(None, "cpu"), contextlib.nullcontext)
    with autocast("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu")


def test_the_option_is_left_out_of_resolved_configs_at_its_default():
    assert "precision" not in config_from_dict({"method": "sgd"}).to_dict()["train"]
    resolved = config_from_dict({"method": "sgd", "train": {"precision": "bf16"}}).to_dict()
    assert resolved["train"]["precision"] == "bf16"
    assert TrainConfig(precision="fp16").precision is Precision.FP16
    with pytest.raises(FlatbmaError, match=r"precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"):
        TrainConfig(precision="fp8")


def test_bad_precision_on_the_command_line_is_one_line(capsys):
    from flatbma.experiment.cli import main

    assert main(["train", "--config", "configs/digits-sam.yaml", "--set", "train.precision=half"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flatbma: error: train.precision must be one of 'fp32', 'bf16', 'fp16'")


def test_the_predictor_and_the_hessian_accept_the_setting():
    from torch.utils.data import DataLoader, TensorDataset

    from flatbma.flatness import hessian_eigenvalues
    from flatbma.predictor import BMA

    _, state, method = train_steps("swag", steps=6)
    x, y = toy_batch(n=96, seed=3)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    torch.manual_seed(0)
    model = tiny_bn_net()
    full = BMA(model, method, state, loader, num_samples=4)
    half = BMA(model, method, state, loader, num_samples=4, precision="bf16")
    log_probs = half.predict_log_proba(x)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.exp(), full.predict_proba(x), atol=0.02, rtol=0)
    a, b = full.evaluate(loader), half.evaluate(loader)
    assert abs(a["nll"] - b["nll"]) < 0.02 and abs(a["accuracy"] - b["accuracy"]) <= 3 / 96
    with pytest.raises(FlatbmaError, match="precision must be one of"):
        BMA(model, method, state, loader, precision="int8")
    weights = full.samples[0]
    exact = hessian_eigenvalues(model, (x, y), k=1, weights=weights, tol=1e-6, max_iter=100)
    with autocast("bf16", "cpu"):  # the Hessian-vector products ignore a caller's autocast
        inside = hessian_eigenvalues(model, (x, y), k=1, weights=weights, tol=1e-6, max_iter=100)
    assert torch.equal(exact, inside)


def test_a_bf16_run_trains_and_evaluates_from_the_command_line(tmp_path, capsys):
    """``train.precision: bf16`` end to end on digits: resolved into config.yaml, metrics near fp32's."""
    import json

    import yaml

    from flatbma.experiment.cli import main

    runs = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        args = ["--set", "train.epochs=2", "--set", "train.progress=false", "--set", f"output_dir={out}"]
        args += ["--set", f"train.precision={precision}"]
        assert main(["train", "--config", "configs/digits-sam.yaml", *args]) == 0
        runs[precision] = json.loads((out / "metrics.json").read_text())
        resolved = yaml.safe_load((out / "config.yaml").read_text())
        assert resolved["train"].get("precision") == (None if precision == "fp32" else "bf16")
    assert abs(runs["fp32"]["accuracy"] - runs["bf16"]["accuracy"]) < 0.05
    assert abs(runs["fp32"]["nll"] - runs["bf16"]["nll"]) < 0.1


def test_a_run_may_change_its_device_on_resume(tmp_path, monkeypatch):
    """``train.device`` is among the keys ``--resume --set`` may change (here: auto, the CPU, to cpu)."""
    from flatbma.experiment.cli import main
    from flatbma.experiment.run.pipeline import train
    from tests.helpers import interrupt_after_first_epoch

    cfg = config_from_dict(
        {
            "method": "sgd",
            "data": {"name": "digits", "batch_size": 64, "test_limit": 200},
            "model": {"name": "mlp"},
            "train": {"epochs": 2, "progress": False},
            "eval": {"num_samples": 1},
            "output_dir": str(tmp_path / "run"),
        }
    )
    reference = train(dataclasses.replace(cfg, output_dir=str(tmp_path / "ref")), evaluate=False)
    interrupt_after_first_epoch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, evaluate=False)
    assert main(["train", "--resume", str(tmp_path / "run"), "--set", "train.device=cpu"]) == 0
    from tests.helpers import load_state

    resumed = load_state(tmp_path / "run" / "checkpoint.safetensors")
    assert all(torch.equal(resumed.params[k], v) for k, v in reference.state.params.items())
    assert "train.device" in (tmp_path / "run" / "resumes.json").read_text()


def test_an_fp16_run_stopped_at_an_epoch_end_resumes_bit_identically(tmp_path, monkeypatch):
    """The loss scale and its count of finite steps are method state: a resumed fp16 run continues exactly."""
    from flatbma.experiment.run.pipeline import train
    from tests.helpers import interrupt_after_first_epoch, load_state

    cfg = config_from_dict(
        {
            "method": {"name": "sam", "rho": 0.05},
            "data": {"name": "digits", "batch_size": 64, "test_limit": 200},
            "model": {"name": "mlp"},
            "train": {"epochs": 2, "progress": False, "precision": "fp16"},
            "eval": {"num_samples": 1},
            "output_dir": str(tmp_path / "run"),
        }
    )
    reference = train(dataclasses.replace(cfg, output_dir=str(tmp_path / "ref")), evaluate=False)
    assert float(reference.state.aux[SCALE]) == 2.0**16 and int(reference.state.aux[GROWTH]) == reference.state.step
    assert reference.metrics["step_stats"]["amp/skipped"]["median"] == 0.0
    interrupt_after_first_epoch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, evaluate=False)
    assert int(load_state(tmp_path / "run" / "checkpoint.safetensors").aux[GROWTH]) > 0
    resumed = train(cfg, resume=True, evaluate=False)
    for part in ("params", "buffers", "aux"):
        a, b = getattr(reference.state, part), getattr(resumed.state, part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_fp16_refuses_members_spread_over_processes(monkeypatch):
    from flatbma.experiment.parallel import processes, strategies
    from flatbma.experiment.run import build

    monkeypatch.setattr(processes, "world_size", lambda: 2)
    with pytest.raises(FlatbmaError, match="one loss scale for the whole state"):
        build._check_one_scale(strategies.Members(sharded=True))
    build._check_one_scale(strategies.Strategy())  # data parallelism: every process holds the whole state
