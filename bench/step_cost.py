"""Cost of one sharpness-aware step relative to one SGD step, measured side by side in one run.

For each model the methods are timed in interleaved rounds on the same batch. In a round every method
runs ``--cycle`` consecutive updates and its step time is their mean, so that a method whose steps
differ in cost (an amortized second pass: one expensive step in ``k``) is timed over whole cycles
(``--cycle`` a multiple of ``k``). The ratio of a method is the median over rounds of its step time
divided by SGD's step time *in the same round* (paired, so a machine that speeds up or slows down during
the run moves both alike); the ms columns are medians.
Goal: SAM, ASAM, FSAM <= 2.1x an SGD step (two forward/backward passes are the floor); their amortized
variants (:class:`flatbma.optim.Amortized`, issue #16) <= 1.3x at ``ascent_every`` = 5: ``k5`` is
LookSAM's reuse of the orthogonal component, ``f.5`` the second pass on half of the batch (ESAM).

A second table times FP-BMA (low-rank Gaussian over the Bayesian subset, FisherBall ascent in θ-space)
against the SGD point update in the transfer setting: MobileNetV2 with only its BatchNorm and
classifier parameters trainable (the rest ``requires_grad=False``), with the isotropic prior and with
the low-rank prior of the two-stage transfer pipeline, and the amortized variants of SAM and FP-BMA.
Goal: <= 2.1x; amortized at k = 5: <= 1.3x.

A third table times every flat-seeking method of ``flatbma methods`` (:data:`FLAT_SEEKING`: SAM, ASAM,
Fisher-SAM, F-SWAG, F-MFVI, FP-BMA), each plain and at ``ascent_every`` = 5 (``k5``), built through the
method registry with its default options, on fully trainable models (:data:`TRAINABLE`: the small CNN,
ResNet-18 of width 16 at 32×32, MobileNetV2 at 64×64) at every ``--trainable-batches``, printing each
method's ``/sgd`` and ``/sam`` (paired medians in the same rounds). Goal (issue #26): FP-BMA ≤ 1.1× SAM.

    python bench/step_cost.py [--rounds 15] [--cycle 5] [--threads 2] [--transfer-batches 32 128] [--no-cg-sweep]
        [--cases "cnn 28x28" "mobilenet_v2 64x64 (transfer)"] [--trainable-cases ...] [--trainable-batches 32 128]
        [--plain-cycle N] [--trainable-methods sam fp-bma ...] [--ivon-cases ...] [--ivon-batches 32] [--quick]

``--plain-cycle`` times the methods without an amortized second pass (and SGD) over ``N`` updates per round
instead of ``--cycle`` (the ``k5`` forms always take whole cycles); ``--quick`` is a smoke test of every
table at batch 2 (one round, no CG sweep): it checks that the script runs, its numbers mean nothing.

A fourth table times IVON (:mod:`flatbma.posteriors.ivon`, issue #37) against the authors' own optimizer, the
``ivon.IVON`` of ``ivon-opt`` (the dev extra) driven by its documented loop (``sampled_params``, ``zero_grad``,
forward, ``backward``, ``step``) on a copy of the same model, with flatbma's SGD and AdamW (``Adam`` with
decoupled weight decay) beside them, on every model of the tables above (:data:`IVON_CASES`: the three fully
trainable models and the transfer model) at every ``--ivon-batches``; it prints ``/sgd``, ``/adamw`` and
``/ivon-opt`` (paired medians in the same rounds). Goal: flatbma's IVON ≤ 1.0× ivon-opt's step on every model.

``--device-table`` prints another table instead, the one ``scripts/gpu-check.sh`` records on a GPU: the step
time and peak memory of SGD, SAM, FP-BMA and low-rank VI (``--methods``) on the transfer model (MobileNetV2,
BatchNorm + classifier trainable) and on ResNet-18 (all trainable), at ``--image-size`` (224) and batch
``--batch`` (128), for every ``--precisions`` (fp32, bf16: :mod:`flatbma.precision`). Each method runs alone:
warm-up, then ``--rounds`` timed steps (the median, GPU synchronized around each), the peak of
``torch.cuda.max_memory_allocated`` over them (CPU: not measured)::

    python bench/step_cost.py --device-table [--batch 128] [--image-size 224] [--precisions fp32 bf16]
        [--models transfer resnet18] [--methods sgd sam fp-bma lowrank-vi] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from flatbma.methods import parse_method
from flatbma.models import build_model
from flatbma.models.heads import classifier_of
from flatbma.optim import ASAM, SAM, SGD, Adam, Amortized, FisherBall, FisherSAM
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import fp_bma, lowrank_vi, point

METHODS = {
    "sgd": None,
    "sam": SAM(0.05),
    "asam": ASAM(0.5),
    "fsam": FisherSAM(0.1),
    "sam k5": Amortized(SAM(0.05), ascent_every=5),
    "asam k5": Amortized(ASAM(0.5), ascent_every=5),
    "fsam k5": Amortized(FisherSAM(0.1), ascent_every=5),
    "sam f.5": Amortized(SAM(0.05), ascent_fraction=0.5),
    "sam k5 f.5": Amortized(SAM(0.05), ascent_every=5, ascent_fraction=0.5),
}
CASES = {
    # name: (model kwargs, batch size, image shape)
    "cnn 28x28": (dict(name="cnn", num_classes=10, in_channels=1, image_size=28), 64, (1, 28, 28)),
    "mobilenet_v2 64x64 (transfer)": (
        dict(name="mobilenet_v2", num_classes=10, in_channels=3, image_size=64),
        32,
        (3, 64, 64),
    ),
}


def bench_case(
    model_kwargs: dict, batch_size: int, shape: tuple, rounds: int, device: str, cycle: int = 1
) -> dict[str, list[float]]:
    """Seconds per step, one entry per round (the mean of ``cycle`` updates), for every method on one model."""
    model = build_model(**model_kwargs, seed=0).to(device).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *shape, generator=g).to(device)
    y = torch.randint(0, model_kwargs["num_classes"], (batch_size,), generator=g).to(device)
    objective = Objective(model=model)
    runs = {}
    for name, ascent in METHODS.items():
        method = point.build(objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4), ascent)
        runs[name] = [method, method.init(trainable_params(model), model_buffers(model)), []]
    return time_updates(runs, (x, y), rounds, device, cycle)


def paired_ratio(times: dict[str, list[float]], name: str, base: str = "sgd") -> float:
    """Median over rounds of ``times[name][r] / times[base][r]``."""
    return statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))


def bayesian_subset_only(model: nn.Module) -> None:
    """Keep only BatchNorm and classifier parameters trainable (selected by module type)."""
    keep = {id(p) for m in model.modules() if isinstance(m, _BatchNorm) for p in m.parameters()}
    keep |= {id(p) for p in classifier_of(model)[1].parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def time_updates(
    runs: dict[str, list], batch: tuple, rounds: int, device: str, cycle: int = 1, cycles: dict[str, int] | None = None
) -> dict[str, list[float]]:
    """Seconds per ``update`` of every ``name: [method, state, []]``, one entry per interleaved round.

    Each entry of a round is the mean over ``cycle`` consecutive updates (``cycles[name]`` where given).
    The warm-up runs whole cycles too, so every round of an amortized method starts at the same point of
    its cycle.
    """
    cycles = {name: (cycles or {}).get(name, cycle) for name in runs}
    for name, entry in runs.items():
        n = cycles[name]
        for _ in range(n * math.ceil(3 / n)):  # warm-up: at least 3 updates, whole cycles
            entry[1], _ = entry[0].update(entry[1], batch)
    for _ in range(rounds):
        for name, entry in runs.items():
            method, state, times = entry
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(cycles[name]):
                state, out = method.update(state, batch)
                float(out.loss)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / cycles[name])
            entry[1] = state
    return {name: entry[2] for name, entry in runs.items()}


FLAT_SEEKING = ("sam", "asam", "fsam", "f-swag", "f-mfvi", "fp-bma")
"""The flat-seeking methods of the registry (``flatbma methods``) in the fully trainable table; each is also
timed at ``ascent_every: 5`` (its ``k5`` form: :class:`flatbma.optim.Amortized`, LookSAM's reuse)."""

ADAM_METHODS = ("f-mfvi", "fp-bma")
"""The variational families, trained with Adam (as their docs advise); the rest with SGD and momentum."""

TRAINABLE = {
    # name: (model kwargs, image shape), every weight trainable
    "cnn 28x28": (dict(name="cnn", num_classes=10, in_channels=1, image_size=28), (1, 28, 28)),
    "resnet18 w16 32x32": (
        dict(name="resnet18", num_classes=10, in_channels=3, image_size=32, width=16),
        (3, 32, 32),
    ),
    "mobilenet_v2 64x64": (dict(name="mobilenet_v2", num_classes=10, in_channels=3, image_size=64), (3, 64, 64)),
}
"""Models of the fully trainable table: the small CNN, ResNet-18 of width 16, MobileNetV2."""


def trainable_methods(objective: Objective, only: list[str] | None = None) -> dict[str, object]:
    """``sgd`` and every :data:`FLAT_SEEKING` method plain and ``k5``, built by the registry with default options.

    ``only``: the names to keep (e.g. ``["sam", "fp-bma"]``; ``sgd`` is always kept, the base of the ratios).
    """
    sgd = SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4)
    methods = {"sgd": parse_method("sgd").build(objective, sgd)}
    for every in (1, 5):
        for name in FLAT_SEEKING:
            section = {"name": name} if every == 1 else {"name": name, "ascent_every": every}
            optimizer = Adam(lr=1e-3) if name in ADAM_METHODS else sgd
            config = parse_method(section)
            if config.options.get("start_step", 0) is None:  # SWAG's default window needs a run's length: from 0
                config = config.with_options(start_step=0)
            if config.options.get("collect_every") == "auto":  # likewise its spacing: every 10th update, as before
                config = config.with_options(collect_every=10)
            label = name if every == 1 else f"{name} k{every}"
            if only is None or label in only:
                methods[label] = config.build(objective, optimizer)
    return methods


def bench_trainable(
    case: str,
    batch_size: int,
    rounds: int,
    device: str,
    cycle: int = 5,
    plain_cycle: int | None = None,
    only: list[str] | None = None,
) -> tuple[dict[str, list[float]], int]:
    """Per-round step times of ``sgd`` and every flat-seeking method (plain and ``k5``) on a fully trainable model.

    The ``k5`` forms are timed over whole cycles of ``cycle`` updates (a multiple of 5), the others over
    ``plain_cycle`` (default ``cycle``). Returns the times and the number of trainable weights.
    """
    kwargs, shape = TRAINABLE[case]
    model = build_model(**kwargs, seed=0).to(device).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *shape, generator=g).to(device)
    y = torch.randint(0, kwargs["num_classes"], (batch_size,), generator=g).to(device)
    objective = Objective(model=model, num_data=1000)
    params, buffers = trainable_params(model), model_buffers(model)
    methods = trainable_methods(objective, only)
    runs = {name: [method, method.init(params, buffers), []] for name, method in methods.items()}
    plain = cycle if plain_cycle is None else plain_cycle
    cycles = {name: cycle if " k" in name else plain for name in runs}
    return time_updates(runs, (x, y), rounds, device, cycle, cycles), sum(v.numel() for v in params.values())


def print_ratios(title: str, times: dict[str, list[float]]) -> None:
    """One row per method: median ms, paired ``/sgd`` and ``/sam`` (``-`` where the table has no SAM)."""
    print(title)
    print(f"{'method':<44}{'ms':>10}{'/sgd':>12}{'/sam':>12}")
    for name in times:
        over_sam = f"{paired_ratio(times, name, 'sam'):>11.2f}x" if "sam" in times else f"{'-':>12}"
        print(f"{name:<44}{statistics.median(times[name]) * 1e3:>10.1f}{paired_ratio(times, name):>11.2f}x{over_sam}")


FP_BMA = {
    "fp-bma (K=5, default cg)": FisherBall(),  # to a residual of 1e-3, at most 20 iterations
    **{f"fp-bma (K=5, cg {n})": FisherBall(cg_iters=n, cg_tol=0.0) for n in (1, 3, 10, 20)},
}
"""FP-BMA rows: the default solve and fixed iteration counts (1 was the default before the residual stop)."""

AMORTIZED_SAM = {
    "sam k5": Amortized(SAM(0.05), ascent_every=5),
    "sam k5 (reuse none)": Amortized(SAM(0.05), ascent_every=5, reuse="none"),
    "sam f.5": Amortized(SAM(0.05), ascent_fraction=0.5),
}
"""SAM with its second pass every 5 steps (LookSAM's reuse, or periodic SAM) or on half of the batch (ESAM)."""

AMORTIZED_FP_BMA = {
    "fp-bma (K=5, k5)": Amortized(FisherBall(), ascent_every=5),
    "fp-bma (K=5, k5, reuse none)": Amortized(FisherBall(), ascent_every=5, reuse="none"),
    "fp-bma (K=5, f.5)": Amortized(FisherBall(), ascent_fraction=0.5),
    "fp-bma (K=5, k5 f.5)": Amortized(FisherBall(), ascent_every=5, ascent_fraction=0.5),
}
"""FP-BMA amortized: the θ-space reuse (one Fisher solve per reuse step), periodic ascent alone, half batch."""


def swag_like_prior(params: dict[str, torch.Tensor], rank: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A fitted SWAG prior's shape: σ ~ 0.002·e^(1.5·N) floored at 0.01 and factor columns of per-weight
    scale 0.003·e^(1.5·N), so factor/σ spreads over orders of magnitude (the hard case of the Fisher solve)."""

    def lognormal(v: torch.Tensor, scale: float) -> torch.Tensor:
        return scale * torch.exp(1.5 * torch.randn(v.shape, generator=generator)).to(v)

    theta = {}
    for name, v in params.items():
        theta[f"mean/{name}"] = v.detach().clone()
        theta[f"log_std/{name}"] = lognormal(v, 0.002).clamp_min(0.01).log()
        theta[f"factor/{name}"] = lognormal(v, 0.003) * torch.randn((rank, *v.shape), generator=generator).to(v)
    return theta


def bench_fp_bma_transfer(
    rounds: int,
    device: str,
    batch_size: int = 32,
    image_size: int = 64,
    cycle: int = 1,
    cg_sweep: bool = True,
) -> tuple[dict[str, list[float]], int]:
    """FP-BMA's update vs the SGD point update on MobileNetV2 with only BN + classifier trainable.

    With ``cg_sweep`` FP-BMA is also timed with fixed CG iteration counts. Returns the per-round step
    times (each the mean of ``cycle`` updates) of every method and the number of trainable weights.
    """
    model = build_model(name="mobilenet_v2", num_classes=10, in_channels=3, image_size=image_size, seed=0)
    model = model.to(device).train()
    bayesian_subset_only(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g).to(device)
    y = torch.randint(0, 10, (batch_size,), generator=g).to(device)
    objective = Objective(model=model, num_data=1000)
    params, buffers = trainable_params(model), model_buffers(model)
    sgd = point.build(objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4))
    sam = point.build(objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4), SAM(0.05))
    runs = {"sgd": [sgd, sgd.init(params, buffers), []], "sam": [sam, sam.init(params, buffers), []]}
    for name, ascent in AMORTIZED_SAM.items():
        method = point.build(objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4), ascent)
        runs[name] = [method, method.init(params, buffers), []]
    for name, ascent in (("lowrank-vi (K=5)", None), ("f-lowrank-vi (K=5, SAM)", SAM(0.05))):
        method = lowrank_vi.build(objective, Adam(lr=1e-3), ascent, rank=5)
        runs[name] = [method, method.init(params, buffers), []]
    default = next(iter(FP_BMA))
    balls = {**(FP_BMA if cg_sweep else {default: FP_BMA[default]}), **AMORTIZED_FP_BMA}
    for name, ball in balls.items():
        method = lowrank_vi.build(objective, Adam(lr=1e-3), ball, rank=5)
        runs[name] = [method, method.init(params, buffers), []]
    # the transfer pipeline's form: KL to a low-rank + diagonal prior (a SWAG posterior), started there
    prior = swag_like_prior(params, 5, g)
    with_prior = {"default cg": FisherBall(), "default cg, k5": Amortized(FisherBall(), ascent_every=5)}
    if cg_sweep:
        with_prior["cg 1"] = FisherBall(cg_iters=1, cg_tol=0.0)
    for name, ball in with_prior.items():
        method = fp_bma.build_with_prior(objective, Adam(lr=1e-3), ball, prior, rank=5)
        runs[f"fp-bma (K=5, {name}, SWAG prior)"] = [method, method.init(prior, buffers), []]
    return time_updates(runs, (x, y), rounds, device, cycle), sum(v.numel() for v in params.values())


IVON_CASES = {
    # name: (model kwargs, image shape, only BatchNorm + classifier trainable)
    **{case: (kwargs, shape, False) for case, (kwargs, shape) in TRAINABLE.items()},
    "mobilenet_v2 64x64 (transfer)": (TRAINABLE["mobilenet_v2 64x64"][0], (3, 64, 64), True),
}
"""Models of the IVON table: the fully trainable ones and the transfer model (BatchNorm + classifier trainable)."""


IVON_ROWS = ("sgd", "adamw", "ivon", "ivon (update alone)", "ivon-opt", "ivon-opt (update alone)")
"""The rows of the IVON table, in order."""


class ReferenceIVON:
    """One step of ``ivon-opt``'s ``IVON`` (the authors' package) in its documented training loop, as a row.

    ``update(state, batch)`` draws ``mc_samples`` weights (``sampled_params(train=True)``), back-propagates the
    mean loss of each through ``model`` itself (a copy of the benchmark's, so the two never share tensors) and
    takes ``optimizer.step()``. ``state`` is unused (the optimizer keeps its own). With ``gradients``
    (``{name: tensor}``) the forward and backward passes are skipped: every sample's gradient is a copy of them.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, gradients: dict | None = None, mc_samples: int = 1
    ) -> None:
        self.model, self.optimizer, self.gradients, self.mc_samples = model, optimizer, gradients, mc_samples

    def init(self, params: dict, buffers: dict) -> None:
        return None

    def update(self, state: None, batch: tuple) -> tuple[None, SimpleNamespace]:
        x, y = batch
        losses = []
        for _ in range(self.mc_samples):
            with self.optimizer.sampled_params(train=True):
                self.optimizer.zero_grad()
                if self.gradients is None:
                    loss = nn.functional.cross_entropy(self.model(x), y)
                    loss.backward()
                else:
                    loss = torch.zeros(())
                    for name, p in self.model.named_parameters():
                        if name in self.gradients:
                            p.grad = self.gradients[name].clone()
            losses.append(loss.detach())
        self.optimizer.step()
        return state, SimpleNamespace(loss=torch.stack(losses).mean())


@dataclasses.dataclass(frozen=True)
class FixedGradients(Objective):
    """An objective whose gradient is a copy of ``gradients`` at any point: a method's update without the passes."""

    gradients: dict = dataclasses.field(default_factory=dict)

    def value_and_grad(self, params, buffers, batch, *, update_buffers=True):
        logits = torch.zeros(batch[0].shape[0], 10, device=batch[0].device)
        return torch.zeros((), device=logits.device), logits, {k: self.gradients[k].clone() for k in params}


ALONE = " (update alone)"
"""Suffix of the rows that time an IVON update with fixed gradients, without the forward and backward passes."""


def bench_ivon(
    case: str, batch_size: int, rounds: int, device: str, cycle: int = 5
) -> tuple[dict[str, list[float]], int]:
    """Per-round step times of flatbma's SGD, AdamW and IVON and of ivon-opt's IVON on one model of :data:`IVON_CASES`.

    The same hyper-parameters for both IVONs (``lr`` 0.1, ``ess`` 1000, ``β₁`` 0.9, ``δ`` 5e-4, the other
    options at their shared defaults). Both are also timed with fixed gradients (rows ``… (update alone)``:
    :class:`FixedGradients`, ``ReferenceIVON(gradients=…)``), the part of the step where the two differ — the
    forward and backward passes are the same computation in both. The ``ivon-opt`` rows are left out, with a
    note, when the package is not installed. Returns the times and the number of trainable weights.
    """
    kwargs, shape, transfer = IVON_CASES[case]
    model = build_model(**kwargs, seed=0).to(device).train()
    if transfer:
        bayesian_subset_only(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *shape, generator=g).to(device)
    y = torch.randint(0, kwargs["num_classes"], (batch_size,), generator=g).to(device)
    objective = Objective(model=model, num_data=1000)
    params, buffers = trainable_params(model), model_buffers(model)
    gradients = {k: torch.randn(v.shape, generator=g).to(v) for k, v in params.items()}
    sgd = SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)
    ivon = parse_method({"name": "ivon", "ess": 1000.0})
    methods = {
        "sgd": point.build(objective, sgd),
        "adamw": point.build(objective, Adam(lr=1e-3, weight_decay=5e-4)),
        "ivon": ivon.build(objective, sgd),
        "ivon" + ALONE: ivon.build(FixedGradients(model=model, num_data=1000, gradients=gradients), sgd),
    }
    try:
        import ivon as reference  # ivon-opt, the dev extra
    except ImportError:
        print("(ivon-opt is not installed: pip install ivon-opt, or the dev extra, for its rows)")
    else:
        for name, given in (("ivon-opt", None), ("ivon-opt" + ALONE, gradients)):
            twin = copy.deepcopy(model)
            trained = [p for p in twin.parameters() if p.requires_grad]
            optimizer = reference.IVON(trained, lr=0.1, ess=1000.0, weight_decay=5e-4)
            methods[name] = ReferenceIVON(twin, optimizer, given)
    runs = {name: [method, method.init(params, buffers), []] for name, method in methods.items()}
    return time_updates(runs, (x, y), rounds, device, cycle), sum(v.numel() for v in params.values())


def print_ivon_ratios(title: str, times: dict[str, list[float]]) -> None:
    """One row per method: median ms, paired ``/sgd``, ``/adamw`` and ``/ivon-opt`` (``-`` without that row).

    The ``… (update alone)`` rows have ``/ivon-opt`` against ``ivon-opt (update alone)`` and no other ratio.
    """
    print(title)
    print(f"{'method':<28}{'ms':>10}{'/sgd':>10}{'/adamw':>10}{'/ivon-opt':>12}")
    for name in times:
        peer_name = "ivon-opt" + ALONE if name.endswith(ALONE) else "ivon-opt"
        peer = f"{paired_ratio(times, name, peer_name):>11.2f}x" if peer_name in times else f"{'-':>12}"
        others = (
            f"{'-':>10}{'-':>10}"
            if name.endswith(ALONE)
            else (f"{paired_ratio(times, name):>9.2f}x{paired_ratio(times, name, 'adamw'):>9.2f}x")
        )
        print(f"{name:<28}{statistics.median(times[name]) * 1e3:>10.1f}{others}{peer}")


DEVICE_MODELS = {
    # name: (model kwargs, only BatchNorm + classifier trainable)
    "transfer": (dict(name="mobilenet_v2", num_classes=10, in_channels=3), True),
    "resnet18": (dict(name="resnet18", num_classes=10, in_channels=3), False),
}
"""Models of the device table: the demo's transfer model and the papers' ResNet-18."""


def device_method(name: str, objective: Objective):
    """The method ``name`` of the device table (the first table's optimizers; FP-BMA and VI at rank 5)."""
    if name in ("sgd", "sam"):
        return point.build(
            objective, SGD(lr=1e-3, momentum=0.9, weight_decay=5e-4), SAM(0.05) if name == "sam" else None
        )
    if name in ("fp-bma", "lowrank-vi"):
        return lowrank_vi.build(objective, Adam(lr=1e-3), FisherBall() if name == "fp-bma" else None, rank=5)
    raise SystemExit(f"step_cost.py: unknown method {name!r} (sgd, sam, fp-bma, lowrank-vi)")


def bench_device_table(
    device: str,
    models: list[str],
    methods: list[str],
    precisions: list[str],
    batch_size: int,
    image_size: int,
    rounds: int,
) -> list[dict]:
    """One row per (model, precision, method): median step time (s), peak memory (MiB; ``None`` on a CPU)."""
    cuda = torch.device(device).type == "cuda"
    rows = []
    for model_name in models:
        kwargs, transfer = DEVICE_MODELS[model_name]
        began = time.perf_counter()
        model = build_model(**kwargs, image_size=image_size, seed=0).to(device).train()
        if transfer:
            bayesian_subset_only(model)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g).to(device)
        y = torch.randint(0, 10, (batch_size,), generator=g).to(device)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"  {model_name}: built in {time.perf_counter() - began:.1f} s", flush=True)
        for precision in precisions:
            objective = Objective(model=model, num_data=10 * batch_size, precision=precision)
            for name in methods:
                began = time.perf_counter()
                method = device_method(name, objective)
                state = method.init(trainable_params(model), model_buffers(model))
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(2):  # warm-up
                    state, out = method.update(state, (x, y))
                times = []
                for _ in range(rounds):
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    state, out = method.update(state, (x, y))
                    float(out.loss)
                    times.append(time.perf_counter() - t0)
                peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
                print(  # as it goes: a stage stopped at its time limit still shows the rows it measured
                    f"  {model_name} {precision} {name}: {statistics.median(times) * 1e3:.1f} ms/step, "
                    f"peak {peak or 0:.0f} MiB ({time.perf_counter() - began:.1f} s with set-up and warm-up)",
                    flush=True,
                )
                rows.append(
                    dict(
                        model=model_name,
                        trainable=trainable,
                        precision=precision,
                        method=name,
                        seconds=statistics.median(times),
                        peak_mib=peak,
                    )
                )
                del state, out, method
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def print_device_table(rows: list[dict], batch_size: int, image_size: int) -> None:
    """The device table: ms per step, ratio to SGD's (same model and precision), peak MiB."""
    print(f"\n{'model':<10}{'trainable':>12}{'precision':>10}{'method':>12}{'ms/step':>10}{'/sgd':>8}{'peak MiB':>10}")
    base = {(r["model"], r["precision"]): r["seconds"] for r in rows if r["method"] == "sgd"}
    for r in rows:
        ratio = (
            r["seconds"] / base[r["model"], r["precision"]] if (r["model"], r["precision"]) in base else float("nan")
        )
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        print(
            f"{r['model']:<10}{r['trainable']:>12,}{r['precision']:>10}{r['method']:>12}"
            f"{r['seconds'] * 1e3:>10.1f}{ratio:>7.2f}x{peak:>10}"
        )
    print(f"(batch {batch_size}, {image_size}x{image_size}; transfer: MobileNetV2, BatchNorm + classifier trainable)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--transfer-batches", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--cycle", type=int, default=5, help="updates per timing (a multiple of ascent_every 5)")
    parser.add_argument("--no-cg-sweep", action="store_true", help="FP-BMA with the default CG solve only")
    parser.add_argument("--cases", nargs="*", default=list(CASES), help=f"models of the first table: {list(CASES)}")
    parser.add_argument(
        "--trainable-cases", nargs="*", default=list(TRAINABLE), help=f"models of the third table: {list(TRAINABLE)}"
    )
    parser.add_argument("--trainable-batches", type=int, nargs="*", default=[32, 128])
    parser.add_argument(
        "--trainable-methods", nargs="*", default=None, help="methods of the third table (default: all; sgd always)"
    )
    parser.add_argument("--plain-cycle", type=int, default=None, help="updates per timing of the methods without k5")
    parser.add_argument(
        "--ivon-cases", nargs="*", default=list(IVON_CASES), help=f"models of the IVON table: {list(IVON_CASES)}"
    )
    parser.add_argument("--ivon-batches", type=int, nargs="*", default=[32])
    parser.add_argument("--quick", action="store_true", help="smoke test: batch 2, one round (numbers mean nothing)")
    parser.add_argument("--device-table", action="store_true", help="the device table instead (module doc)")
    parser.add_argument("--batch", type=int, default=128, help="device table: batch size")
    parser.add_argument("--image-size", type=int, default=224, help="device table: image side")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--models", nargs="+", default=list(DEVICE_MODELS), choices=list(DEVICE_MODELS))
    parser.add_argument("--methods", nargs="+", default=["sgd", "sam", "fp-bma", "lowrank-vi"])
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.cycle, args.no_cg_sweep = 1, 5, True
        args.transfer_batches = [2] if args.transfer_batches else []
        args.trainable_batches = [2] if args.trainable_batches else []
        args.ivon_batches = [2] if args.ivon_batches else []
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device_table:
        print(f"device={args.device} torch={torch.__version__} rounds={args.rounds}")
        rows = bench_device_table(
            args.device, args.models, args.methods, args.precisions, args.batch, args.image_size, args.rounds
        )
        print_device_table(rows, args.batch, args.image_size)
        return
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} rounds={args.rounds} "
        f"cycle={args.cycle} load average (1, 5, 15 min) at start: {load}"
    )
    if args.cases:
        print(f"{'model':<32}{'sgd ms':>10}" + "".join(f"{m + '/sgd':>15}" for m in METHODS if m != "sgd"))
    for case in args.cases:
        kwargs, bs, shape = CASES[case]
        bs = 2 if args.quick else bs
        t = bench_case(kwargs, bs, shape, args.rounds, args.device, args.cycle)
        ratios = "".join(f"{paired_ratio(t, m):>14.2f}x" for m in METHODS if m != "sgd")
        print(f"{case + f' (batch {bs})':<32}{statistics.median(t['sgd']) * 1e3:>10.1f}{ratios}")
    for batch_size in args.transfer_batches:  # the VI overhead is per step, the passes scale with the batch
        t, trainable = bench_fp_bma_transfer(
            args.rounds, args.device, batch_size=batch_size, cycle=args.cycle, cg_sweep=not args.no_cg_sweep
        )
        print_ratios(
            f"\nmobilenet_v2 64x64 transfer, BN + classifier trainable ({trainable} weights), batch {batch_size}", t
        )
    for case in args.trainable_cases:
        for batch_size in args.trainable_batches:
            t, trainable = bench_trainable(
                case, batch_size, args.rounds, args.device, args.cycle, args.plain_cycle, args.trainable_methods
            )
            print_ratios(f"\n{case}, all {trainable:,} weights trainable, batch {batch_size}", t)
    for case in args.ivon_cases:
        for batch_size in args.ivon_batches:
            t, trainable = bench_ivon(case, batch_size, args.rounds, args.device, args.cycle)
            print_ivon_ratios(f"\nIVON: {case}, {trainable:,} weights trainable, batch {batch_size}", t)
    print(f"load average (1, 5, 15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
