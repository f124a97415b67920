"""Whether two versions of the code take the same FP-BMA steps: ``θ`` and every recorded statistic, bit for bit.

    PYTHONPATH=/tmp/old/src python bench/fp_bma_identity.py --out /tmp/old.pt
    python bench/fp_bma_identity.py --out /tmp/new.pt --compare /tmp/old.pt

Runs ``--steps`` updates of several FP-BMA configurations on ``bench/step_cost.py``'s fully trainable CNN (the
default isotropic prior, a SWAG-like low-rank prior with ``q`` started at it, small and large ``γ``, the
trust-region bisection, ``k5``, the float64 solve) and saves every step's loss, statistics and the final ``θ``;
with ``--compare`` it prints, per configuration, the largest absolute difference of each against another run's
file (0 everywhere: bit-identical). Refactors that keep the maths must print 0.
"""

from __future__ import annotations

import argparse
import math

import torch
from step_cost import TRAINABLE

from flatbma.methods import parse_method
from flatbma.models import build_model
from flatbma.optim import Adam, FisherBall
from flatbma.params import Objective, model_buffers, trainable_params

CONFIGS = {
    "isotropic": ({"name": "fp-bma"}, False),
    "swag prior": ({"name": "fp-bma"}, True),
    "gamma 0.01": ({"name": "fp-bma", "gamma": 0.01}, False),
    "gamma 1e4": ({"name": "fp-bma", "gamma": 1e4}, False),
    "swag prior, gamma 1e5, max_kl_ratio 1": ({"name": "fp-bma", "gamma": 1e5, "max_kl_ratio": 1.0}, True),
    "swag prior, gamma 10, damping 1e-6": ({"name": "fp-bma", "gamma": 10, "damping": 1e-6, "max_kl_ratio": 1}, True),
    "swag prior, gamma 1e3": ({"name": "fp-bma", "gamma": 1e3}, True),
    "k5": ({"name": "fp-bma", "ascent_every": 5}, False),
    "float64 solve": ({"name": "fp-bma", "precision": "float64"}, True),
    "rank 10, damping 1e-4": ({"name": "fp-bma", "rank": 10, "damping": 1e-4}, True),
}


def swag_like_prior(params: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A fixed low-rank prior around the weights, its factor columns of spread sizes (SWAG-like)."""
    g = torch.Generator().manual_seed(1)
    prior = {}
    for name, p in params.items():
        prior[f"mean/{name}"] = p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        prior[f"log_std/{name}"] = math.log(0.005) + 0.5 * torch.randn(p.shape, generator=g)
        col = torch.logspace(-3, -1, rank)[:, None].expand(rank, p.numel())
        prior[f"factor/{name}"] = (col * torch.randn(rank, p.numel(), generator=g)).reshape(rank, *p.shape)
    return prior


def run(steps: int, batch: int) -> dict[str, dict[str, torch.Tensor]]:
    bisected = [0]  # steps whose trust region cut the step (t < 1), to show that the bisection ran
    trust_region = FisherBall._trust_region

    def counted(self, *args):
        t = trust_region(self, *args)
        bisected[0] += t < 1
        return t

    FisherBall._trust_region = counted
    try:
        return _run(steps, batch, bisected)
    finally:
        FisherBall._trust_region = trust_region


def _run(steps: int, batch: int, bisected: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    kwargs, shape = TRAINABLE["cnn 28x28"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, kwargs["num_classes"], (batch,), generator=g)
    out = {}
    for label, (section, with_prior) in CONFIGS.items():
        model = build_model(**kwargs, seed=0).train()
        objective = Objective(model=model, num_data=1000)
        params, buffers = trainable_params(model), model_buffers(model)
        config = parse_method(section)
        prior = swag_like_prior(params, section.get("rank", 5)) if with_prior else None
        method = config.build(objective, Adam(lr=1e-3), prior)
        torch.manual_seed(7)  # the run's seed (new_seed) and so θ's initial factor
        state = method.init(prior if with_prior else params, buffers)
        bisected[0] = 0
        record: dict[str, list[torch.Tensor]] = {"loss": []}
        for _ in range(steps):
            state, step = method.update(state, (x, y))
            record["loss"].append(step.loss.detach().to(torch.float64))
            for k, v in step.stats.items():
                record.setdefault(k, []).append(torch.as_tensor(v).detach().to(torch.float64))
        result = {k: torch.stack(v) for k, v in record.items()}
        result["bisected"] = torch.tensor(float(bisected[0]))
        result.update({f"theta/{k}": v.detach().clone() for k, v in state.params.items()})
        out[label] = result
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    result = run(args.steps, args.batch)
    torch.save(result, args.out)
    if args.compare is None:
        return
    other = torch.load(args.compare)
    worst_all = 0.0
    for label, values in result.items():
        diffs = {}
        for key, v in values.items():
            ref = other[label][key]
            diffs[key] = float((v.to(torch.float64) - ref.to(torch.float64)).abs().max())
        theta = max(d for k, d in diffs.items() if k.startswith("theta/"))
        stats = {k: d for k, d in diffs.items() if not k.startswith("theta/") and k != "bisected"}
        kl = values.get("ascent/kl")
        kl_text = (
            f" (last ascent/kl {float(kl[-1]):.6g}, {int(values['bisected'])} steps bisected)" if kl is not None else ""
        )
        print(f"{label:<38} max|Δθ| {theta:.3g}; " + ", ".join(f"{k} {d:.3g}" for k, d in stats.items()) + kl_text)
        worst_all = max(worst_all, theta, *stats.values())
    print("bit-identical" if worst_all == 0 else f"DIFFERENT: largest difference {worst_all:.3g}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
