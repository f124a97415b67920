"""OOD detection (``eval.ood``): the AUROC of the BMA's predictive entropy and mutual information, against an
independent computation (per-sample softmax by hand, entropies in numpy, scikit-learn's AUROC); the OOD sets;
``flatbma evaluate --ood``; the report's table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from sklearn.metrics import roc_auc_score
from torch.func import functional_call

from flatbma.data import ArrayDataset, load_dataset
from flatbma.data.corruptions import corrupt_dataset
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.report.tables import report_tables
from flatbma.experiment.run.evaluate import draw_samples
from flatbma.experiment.run.pipeline import train
from flatbma.ood import ood_dataset, ood_metrics
from flatbma.types import Predictive
from tests.helpers import DONE

RUN = {
    "seed": 1,
    "method": {"name": "swag", "rank": 3, "start_step": 10, "collect_every": 2},
    "data": {"name": "digits", "batch_size": 64, "eval_batch_size": 128, "test_limit": 200},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05},
    "train": {"epochs": 3, "progress": False},
    "eval": {"num_samples": 4, "ood": "animal-mnist"},
}
CLEAN = ("accuracy", "nll", "ece", "aece", "brier")


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)


def _scores_by_hand(model, samples, dataset) -> tuple[np.ndarray, np.ndarray]:
    """Predictive entropy and mutual information of every example: each sample's softmax, then numpy."""
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    model.eval()
    with torch.no_grad():
        p = np.stack([torch.softmax(functional_call(model, w, (x,)), -1).double().numpy() for w in samples])
    total = _entropy(p.mean(0))
    return total, total - _entropy(p).mean(0)


def test_the_auroc_of_entropy_and_mutual_information_equal_an_independent_computation(tmp_path: Path) -> None:
    cfg = config_from_dict({**RUN, "output_dir": str(tmp_path / "run")})
    trained = train(cfg, evaluate=True)
    ood = trained.metrics["ood"]
    exp = trained.experiment
    samples = draw_samples(exp, trained.state)  # an MLP without BatchNorm: the BMA's samples as drawn
    test = exp.test_loader.dataset
    shifted = ood_dataset("animal-mnist", test, seed=cfg.seed)
    h_in, mi_in = _scores_by_hand(exp.model, samples, test)
    h_out, mi_out = _scores_by_hand(exp.model, samples, shifted)
    truth = np.r_[np.zeros(len(h_in)), np.ones(len(h_out))]
    assert ood["set"] == "animal-mnist" and (ood["n_in"], ood["n_out"]) == (len(test), 2000)
    pairs = 10 / (len(h_in) * len(h_out))  # float32 logits summed in another order flip a few near-tied pairs
    assert ood["auroc_entropy"] == pytest.approx(roc_auc_score(truth, np.r_[h_in, h_out]), abs=pairs)
    assert ood["auroc_mutual_information"] == pytest.approx(roc_auc_score(truth, np.r_[mi_in, mi_out]), abs=pairs)
    assert ood["entropy_out"] == pytest.approx(h_out.mean(), rel=1e-5)
    assert ood["mutual_information_in"] == pytest.approx(mi_in.mean(), rel=1e-4)
    assert ood["auroc_entropy"] > 0.5  # silhouettes of animals look unlike digits to a digit classifier
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert on_disk["ood"] == ood

    # `flatbma evaluate --ood`: another set for one evaluation, every other number unchanged
    assert main(["evaluate", str(tmp_path / "run"), "--ood", "gaussian_noise", "--quiet"]) in DONE
    again = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert again["ood"]["set"] == "gaussian_noise" and again["ood"]["n_out"] == len(test)
    assert [again[k] for k in CLEAN] == [on_disk[k] for k in CLEAN]
    assert main(["evaluate", str(tmp_path / "run"), "--ood", "animal_mnist", "--quiet"]) == 2


def test_a_run_without_eval_ood_records_none_and_its_config_is_unchanged() -> None:
    cfg = config_from_dict({k: v for k, v in RUN.items() if k != "eval"})
    assert cfg.eval.ood is None and "ood" not in cfg.to_dict()["eval"]  # resolved configs of old runs still match


def test_ood_sets_are_shaped_like_the_test_set() -> None:
    digits = load_dataset("digits").test
    shifted = ood_dataset("animal-mnist", digits, seed=0)
    assert shifted.image_shape == digits.image_shape and shifted.images.dtype == digits.images.dtype
    assert shifted.transform is digits.transform
    corrupted = ood_dataset("contrast", digits, seed=3)
    assert torch.equal(corrupted.images, corrupt_dataset(digits, "contrast", 5, seed=3).images)  # severity 5
    grey = ArrayDataset(torch.full((2, 1, 4, 4), 0.5), torch.zeros(2, dtype=torch.int64), ["a"])
    with pytest.raises(FlatbmaError, match="colour"):
        ood_dataset("saturate", grey, seed=0)
    rgb = ArrayDataset(torch.rand(3, 3, 8, 8), torch.zeros(3, dtype=torch.int64), ["a"])
    to_rgb = ood_dataset("digits", rgb, seed=0)
    assert to_rgb.image_shape == (3, 8, 8) and torch.equal(to_rgb.images[:, 0], to_rgb.images[:, 2])
    with pytest.raises(FlatbmaError, match=r"neither a corruption nor a data set.*Did you mean 'gaussian_noise'"):
        config_from_dict({"method": {"name": "sgd"}, "eval": {"ood": "gaussian-noise"}})


def test_ood_metrics_by_hand() -> None:
    scores_in = {"total": torch.tensor([0.1, 0.5]), "epistemic": torch.tensor([0.0, 0.2])}
    scores_out = {"total": torch.tensor([0.5, 0.9]), "epistemic": torch.tensor([0.1, 0.0])}
    out = ood_metrics(scores_in, scores_out, name="x", predictive=Predictive.SAMPLES)
    # entropy pairs (in, out): (0.1,0.5) 1, (0.1,0.9) 1, (0.5,0.5) ½, (0.5,0.9) 1 -> 3.5/4
    assert out["auroc_entropy"] == 3.5 / 4
    # mutual information: (0,0.1) 1, (0,0) ½, (0.2,0.1) 0, (0.2,0) 0 -> 1.5/4
    assert out["auroc_mutual_information"] == 1.5 / 4
    assert out["entropy_in"] == pytest.approx(0.3) and out["mutual_information_out"] == pytest.approx(0.05)
    probit = ood_metrics(scores_in, scores_out, name="x", predictive=Predictive.PROBIT)
    assert probit["auroc_mutual_information"] is None and probit["auroc_entropy"] == 3.5 / 4


def test_the_report_shows_an_ood_table() -> None:
    runs = [
        {"method": m, "seed": s, "accuracy": 0.9, "nll": 0.3, "ece": 0.02, "aece": 0.02, "brier": 0.1, "ood": o}
        for m, s, o in [
            ("sgd", 0, {"set": "animal-mnist", "auroc_entropy": 0.8, "auroc_mutual_information": 0.5}),
            ("swag", 0, {"set": "animal-mnist", "auroc_entropy": 0.85, "auroc_mutual_information": 0.9}),
        ]
    ]
    tables = report_tables({"runs": runs})
    ood = [t for t in tables if t.title.startswith("Out-of-distribution")]
    assert len(ood) == 1 and "animal-mnist" in ood[0].title
    assert ood[0].header[2:4] == ["AUROC of entropy", "AUROC of mutual information"]
    assert [row[2] for row in ood[0].rows] == ["0.8000", "0.8500"]
    assert not [
        t
        for t in report_tables({"runs": [{k: v for k, v in r.items() if k != "ood"} for r in runs]})
        if t.title.startswith("Out-of-distribution")
    ]


def test_compare_records_ood_in_results_json_and_the_report(tmp_path: Path, capsys) -> None:
    config = {
        "output_dir": str(tmp_path / "out"),
        "data": {"name": "digits", "batch_size": 64, "test_limit": 100, "k_shot": 10},
        "model": {"name": "mlp"},
        "optim": {"lr": 0.05},
        "train": {"epochs": 2, "progress": False},
        "eval": {"num_samples": 3, "ood": "gaussian_noise"},
        "compare": {
            "methods": [{"name": "sgd"}, {"name": "swag", "rank": 2, "start_step": 1, "collect_every": 1}],
            "flatness": False,
            "landscape": False,
            "bma_curve": [3],
        },
    }
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["compare", "--config", str(path), "--quiet"]) in DONE, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    by_method = {run["method"]: run["ood"] for run in results["runs"]}
    assert by_method["sgd"]["set"] == "gaussian_noise" and by_method["sgd"]["auroc_mutual_information"] == 0.5
    assert by_method["sgd"]["mutual_information_in"] == 0.0  # a point estimate has no epistemic part
    assert 0 <= by_method["swag"]["auroc_mutual_information"] <= 1 and by_method["swag"]["mutual_information_in"] > 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Out-of-distribution detection: test set against gaussian_noise" in report
    assert "AUROC of mutual information" in report


def test_a_corruption_that_does_not_apply_is_refused_before_training(tmp_path: Path) -> None:
    from flatbma.experiment.run.validate import validate_run

    cfg = config_from_dict({**RUN, "output_dir": str(tmp_path / "run"), "eval": {"ood": "saturate"}})
    with pytest.raises(FlatbmaError, match="needs colour images"):
        validate_run(cfg)
    assert not (tmp_path / "run").exists()
