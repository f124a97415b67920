"""Where the time of one training step goes: a ``torch.profiler`` table of one method's update on one model.

    python bench/step_profile.py [--model resnet18] [--method fp-bma] [--batch 128] [--image-size 224]
        [--steps 5] [--rows 25] [--device cuda]

Builds the device table's model and method (:func:`step_cost.device_method`: SGD/SAM point updates, low-rank VI
and FP-BMA at rank 5), warms up two steps, profiles ``--steps`` updates and prints the operators sorted by their
self time on the device (CUDA) or the CPU, and the step's median wall time. A diagnostic, not a benchmark: the
profiler adds overhead, so read shares, not absolute times (bench/step_cost.py measures those).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_cost import DEVICE_MODELS, bayesian_subset_only, device_method
from torch.profiler import ProfilerActivity, profile

from flatbma.models import build_model
from flatbma.params import Objective, model_buffers, trainable_params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", choices=list(DEVICE_MODELS))
    parser.add_argument("--method", default="fp-bma", choices=["sgd", "sam", "fp-bma", "lowrank-vi"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    kwargs, transfer = DEVICE_MODELS[args.model]
    model = build_model(**kwargs, image_size=args.image_size, seed=0).to(args.device).train()
    if transfer:
        bayesian_subset_only(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(args.device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(args.device)
    method = device_method(args.method, Objective(model=model, num_data=10 * args.batch))
    state = method.init(trainable_params(model), model_buffers(model))
    for _ in range(2):
        state, _ = method.update(state, (x, y))

    def timed_step():
        nonlocal state
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        state, out = method.update(state, (x, y))
        float(out.loss)
        return time.perf_counter() - t0

    plain = [timed_step() for _ in range(args.steps)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        profiled = [timed_step() for _ in range(args.steps)]
    print(
        f"{args.model} {args.method} batch {args.batch} {args.image_size}x{args.image_size} on {args.device}: "
        f"{statistics.median(plain) * 1e3:.1f} ms/step (profiled: {statistics.median(profiled) * 1e3:.1f})"
    )
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
