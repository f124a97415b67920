"""Smoke test: the step-cost benchmark's FP-BMA table runs (tiny batch and images; no timing asserted)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import step_cost


@pytest.mark.slow
def test_fp_bma_transfer_bench_times_every_method():
    times, trainable = step_cost.bench_fp_bma_transfer(rounds=2, device="cpu", batch_size=2, image_size=32)
    assert trainable > 0
    assert {"sgd", "sam", "fp-bma (K=5, cg 1)", "fp-bma (K=5, cg 1, SWAG prior)"} <= set(times)
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert step_cost.paired_ratio(times, "sgd") == 1.0
    assert step_cost.paired_ratio({"a": [2.0, 9.0, 3.0], "sgd": [1.0, 3.0, 1.0]}, "a") == 3.0


@pytest.mark.slow
def test_step_cost_quick_times_every_flat_seeking_method_on_a_trainable_model(capsys):
    """``--quick`` runs the fully trainable table: a row per method, plain and k5, with /sgd and /sam (not timed)."""
    step_cost.main(["--quick", "--cases", "--transfer-batches", "--ivon-cases", "--trainable-cases", "cnn 28x28"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("cnn 28x28, all 94,186 weights trainable, batch 2") for line in lines)
    names = ["sgd", *step_cost.FLAT_SEEKING, *(f"{m} k5" for m in step_cost.FLAT_SEEKING)]
    assert names[1:7] == ["sam", "asam", "fsam", "f-swag", "f-mfvi", "fp-bma"]
    rows = {line.split()[0] + (" k5" if " k5 " in line else ""): line.split() for line in lines if line[:1].isalpha()}
    for name in names:
        assert name in rows, name
        ms, over_sgd, over_sam = rows[name][-3:]
        assert float(ms) > 0 and over_sgd.endswith("x") and over_sam.endswith("x")
    assert rows["sgd"][-2] == "1.00x" and rows["sam"][-1] == "1.00x"


def test_reuse_fidelity_measures_without_changing_the_run():
    """The measuring wrapper's trajectory is the amortized step's own, bit for bit, and α = 0 gives error 1."""
    import reuse_fidelity
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from flatbma.loop import fit
    from flatbma.optim import SAM, SGD, Amortized
    from flatbma.params import Objective, model_buffers, trainable_params
    from flatbma.posteriors import point

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g)

    def train(alpha, measure):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
        step = Amortized(SAM(0.05), ascent_every=3, reuse_alpha=alpha)
        ascent = reuse_fidelity.Measured(step) if measure else step
        method = point.build(Objective(model, num_data=64), SGD(lr=0.1, momentum=0.9), ascent)
        loader = DataLoader(
            TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        state, _ = fit(
            method, method.init(trainable_params(model), model_buffers(model)), loader, epochs=3, progress=False
        )
        return state, ascent

    plain, _ = train(0.7, False)
    measured, probe = train(0.7, True)
    for section in ("params", "buffers", "aux"):
        ours, theirs = getattr(measured, section), getattr(plain, section)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert sorted(probe.records) == [1, 2] and sum(map(len, probe.records.values())) == 8  # 12 steps, 4 ascents
    assert all(abs(r[1] - 0.7) < 1e-5 for rows in probe.records.values() for r in rows)  # ‖g̃ − g‖ = α‖g‖
    _, zero = train(0.0, True)
    assert all(r[1] == 0 and abs(r[3] - 1) < 1e-12 for rows in zero.records.values() for r in rows)


@pytest.mark.slow
def test_step_profile_prints_the_step_time_and_the_operators_table(capsys):
    import step_profile

    step_profile.main(
        "--model transfer --method fp-bma --device cpu --batch 2 --image-size 32 --steps 1 --rows 5".split()
    )
    out = capsys.readouterr().out
    assert "transfer fp-bma batch 2 32x32 on cpu:" in out and "ms/step" in out
    assert "Self CPU" in out and "aten::" in out


@pytest.mark.slow
def test_fp_bma_profile_prints_the_shares_and_the_floor(capsys):
    import fp_bma_profile

    fp_bma_profile.main("--batch 2 --steps 1".split())
    out = capsys.readouterr().out
    assert "fp-bma/sam" in out and "CG solve" in out and "floor of FP-BMA/SAM" in out


@pytest.mark.slow
def test_fp_bma_identity_finds_a_run_identical_to_itself(tmp_path, capsys):
    import fp_bma_identity

    first = str(tmp_path / "first.pt")
    fp_bma_identity.main(["--out", first, "--steps", "1", "--batch", "2"])
    fp_bma_identity.main(["--out", str(tmp_path / "second.pt"), "--compare", first, "--steps", "1", "--batch", "2"])
    assert capsys.readouterr().out.strip().endswith("bit-identical")


@pytest.mark.slow
def test_step_cost_quick_times_ivon_against_ivon_opt(capsys):
    """``--quick`` runs the IVON table: sgd, adamw, ivon and ivon-opt's own step, with /sgd, /adamw, /ivon-opt."""
    step_cost.main(["--quick", "--cases", "--transfer-batches", "--trainable-cases", "--ivon-cases", "cnn 28x28"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("IVON: cnn 28x28, 94,186 weights trainable, batch 2") for line in lines)
    rows = {name: line.split() for line in lines for name in step_cost.IVON_ROWS if line.startswith(name + "  ")}
    assert list(rows) == list(step_cost.IVON_ROWS)
    assert rows["sgd"][2] == "1.00x" and rows["adamw"][3] == "1.00x" and rows["ivon-opt"][4] == "1.00x"
    assert rows["ivon-opt (update alone)"][-1] == "1.00x" and rows["ivon (update alone)"][-2] == "-"
