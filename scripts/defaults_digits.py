"""Every method with its defaults on digits, from scratch: does its posterior act? (issue #35).

A small CNN with BatchNorm (``SmallCNN(1, 10, width)``) trained by ``flatbma.fit_posterior`` with each method's
defaults (``lr`` 0.05, the default optimizer: SGD with momentum, weight decay and a cosine schedule) on
scikit-learn's 8x8 digits (2/3 train, 1/3 test, the library's split); printed per method, on the test images:
the BMA's NLL and accuracy, its posterior mean's (a point estimate at :meth:`flatbma.BMA.mean`, for a
mixture: member 0 alone), their ratio, and the median marginal standard deviation of the posterior over the
trained weights (``√ marginal_variance`` where the family has one in closed form, else the samples' spread).

    .venv/bin/python scripts/defaults_digits.py [--epochs 20] [--methods sgd,swag,...] [--width 16] [--val 200]

``--methods`` takes names or method sections in YAML flow style, separated by ``;`` when any has options:
``--methods "mfvi;{name: mfvi, kl_weight: 0.1}"``.

Prints one line per method, the warnings ``fit_posterior`` gave (with ``--val N``: its health check on N held-out
training images, else on the training data), and, with ``--json PATH``, writes them.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma.data import load_digits
from flatbma.models.small import SmallCNN
from flatbma.predict import evaluate

METHODS = ("sgd", "swag", "mfvi", "lowrank-vi", "fp-bma", "laplace", "ensemble", "multiswag", "mc-dropout", "sgld")


def median_std(bma: flatbma.BMA) -> float:
    """The median marginal standard deviation over the trained weights (closed form, else over the samples)."""
    names = [n for n, p in bma.model.named_parameters() if p.requires_grad]
    if bma.method.marginal_variance is not None and bma.method.can.members == 0:
        variance = bma.method.marginal_variance(bma.state)
        return float(torch.cat([variance[n].reshape(-1) for n in names if n in variance]).sqrt().median())
    samples = bma.samples
    if len(samples) < 2:
        return 0.0
    stacked = torch.stack([torch.cat([w[n].reshape(-1) for n in names]) for w in samples])
    return float(stacked.std(0).median())


def main() -> None:
    """Train every method asked for and print its line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--val", type=int, default=0, help="hold out this many training images as val_loader")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    splits = load_digits()
    images, labels = splits.train.images, splits.train.labels
    val = None
    if args.val:  # a fixed random hold-out: fit_posterior's health check then reads validation data
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        held, kept = order[: args.val], order[args.val :]
        val = DataLoader(TensorDataset(images[held], labels[held]), batch_size=256)
        images, labels = images[kept], labels[kept]
    train = TensorDataset(images, labels)
    test = DataLoader(TensorDataset(splits.test.images, splits.test.labels), batch_size=256)
    rows = []
    entries = args.methods.split(";") if ";" in args.methods or "{" in args.methods else args.methods.split(",")
    for entry in entries:
        section = yaml.safe_load(entry)
        name = section if isinstance(section, str) else yaml.safe_dump(section, default_flow_style=True).strip()
        torch.manual_seed(args.seed)
        model = SmallCNN(1, 10, width=args.width)
        loader = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(args.seed))
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                bma = flatbma.fit_posterior(
                    model, loader, section, epochs=args.epochs, lr=args.lr, progress=False, val_loader=val
                )
            except flatbma.FlatbmaError as e:
                print(f"{name:11s} refused: {e}", flush=True)
                rows.append({"method": name, "refused": str(e)})
                continue
        ours = bma.evaluate(test)
        point = bma.member(0) if bma.method.can.members else bma.mean()  # a mixture: its member 0 (BMA.load_into)
        mean = evaluate(bma.model, [point], test, num_classes=10)
        row = {
            "method": name,
            "bma_nll": ours["nll"],
            "bma_accuracy": ours["accuracy"],
            "mean_nll": mean["nll"],
            "mean_accuracy": mean["accuracy"],
            "median_std": median_std(bma),
            "warnings": [str(w.message)[:200] for w in caught if issubclass(w.category, flatbma.FlatbmaWarning)],
            "time_s": time.perf_counter() - start,
            "repr": repr(bma),
        }
        rows.append(row)
        print(
            f"{name:11s} BMA NLL {row['bma_nll']:.4f} acc {row['bma_accuracy']:.4f} | mean NLL {row['mean_nll']:.4f} "
            f"acc {row['mean_accuracy']:.4f} | ratio {row['bma_nll'] / row['mean_nll']:.3f} | median std "
            f"{row['median_std']:.3g} | {row['time_s']:.0f}s | warned {len(row['warnings'])}",
            flush=True,
        )
        for w in row["warnings"]:
            print(f"    warning: {w}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
