"""The detectable difference in ``scripts/compare_progress.py``'s paired table, and ``scripts/refind.py``.

Neither trains: compare_progress reads row caches written here, refind a results dict built here.
"""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import yaml

from flatbma.experiment.report.findings import findings
from flatbma.experiment.study.plan import load_plan
from tests.helpers import DETECTABLE_PER_S

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1, 2)
NOISE = (0.013, -0.021, 0.008)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(k, seed):
    """A row's numbers: a shift k between rows, seed-to-seed noise that the rows do not share."""
    e = NOISE[(seed + k) % len(NOISE)]
    return {
        "accuracy": 0.7 + 0.05 * k + e,
        "nll": 0.9 + 2 * e,
        "ece": 0.05 + e / 10,
        "temperature_scaled": {"nll": 0.85 + e},
        "lambda1_summary": {"median": 100.0 + 30 * k + 500 * e},
        "width": {"trace_cov": 2.0 + k + e},
    }


def test_compare_progress_prints_each_difference_with_its_detectable_difference(tmp_path, capsys):
    config = tmp_path / "study.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data": {"name": "digits", "k_shot": 10},
                "model": {"name": "mlp"},
                "compare": {"methods": [{"name": "sgd"}, {"name": "swag"}], "seeds": list(SEEDS)},
            }
        )
    )
    out = tmp_path / "out"
    rows = {}
    for job in load_plan(config, [f"output_dir={out}"]).jobs():  # the row caches flatbma compare writes
        k = ["sgd", "swag"].index(job.label)
        rows[job.label, job.seed] = _result(k, job.seed)
        job.row_dir.mkdir(parents=True, exist_ok=True)
        (job.row_dir / "compare.json").write_text(json.dumps({"result": rows[job.label, job.seed]}))
    progress = _script("compare_progress")
    progress.main(str(out), str(config), "sgd")
    printed = capsys.readouterr().out.splitlines()
    table = printed[next(i for i, x in enumerate(printed) if x.startswith("| row − sgd |")) :]
    (line,) = [x for x in table if x.startswith("| swag | 3 |")]
    cells = [c.strip() for c in line.strip("|").split("|")][2:]
    assert len(cells) == len(progress.COMPARED)
    for metric, cell in zip(progress.COMPARED, cells):
        d = [progress.value(rows["swag", s], metric) - progress.value(rows["sgd", s], metric) for s in SEEDS]
        detectable = DETECTABLE_PER_S[3] * statistics.stdev(d)
        shown = cell.split(", detectable ")[1]
        assert float(shown) == pytest.approx(detectable, rel=5e-4), (metric.label, cell)  # 4 significant digits
        assert cell.startswith(f"{statistics.mean(d):+.4g} [")
    # the NLL differences (−0.068, 0.058, 0.010) include 0
    assert progress.COMPARED[1].key == "nll" and " ns, detectable " in cells[1]


def _results():
    runs = [{"method": m, "seed": s, **_result(k, s)} for k, m in enumerate(["sgd", "swag"]) for s in SEEDS]
    old = {"reference": "sgd", "level": 0.95, "text": ["swag vs sgd: NLL ...: no significant difference"]}
    return {"config_hash": "abc", "created": "2024-01-01T00:00:00", "compare": {}, "runs": runs, "findings": old}


def test_refind_rewrites_the_findings_alone_and_the_reports(tmp_path, capsys):
    source = tmp_path / "study" / "results.json"
    source.parent.mkdir()
    results = _results()
    source.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    before = source.read_bytes()
    refind = _script("refind")
    assert refind.main([str(source), "--out", str(tmp_path / "new")]) == 0
    assert source.read_bytes() == before  # --out leaves the source as it was
    new = json.loads((tmp_path / "new" / "results.json").read_text())
    assert new == {**results, "findings": findings(results)}  # every other key as it was
    assert all("detectable" in c for c in new["findings"]["comparisons"])
    assert not any("no significant difference" in line for line in new["findings"]["text"])
    md = (tmp_path / "new" / "report.md").read_text()
    assert "| NLL | NLL detectable |" in md and "no difference larger than" in md
    assert "wrote" in capsys.readouterr().out
    assert refind.main([str(source)]) == 0  # in place
    assert json.loads(source.read_text()) == new
    assert (source.parent / "report.html").exists()


def test_refind_refuses_what_is_not_a_results_json_in_one_line(tmp_path, capsys):
    refind = _script("refind")
    bad = tmp_path / "results.json"
    bad.write_text("[1, 2]")
    assert refind.main([str(bad)]) == 2
    assert refind.main([str(tmp_path / "missing.json")]) == 2
    bad.write_text(json.dumps({"runs": []}))
    assert refind.main([str(bad)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(e.startswith("refind: error: ") for e in errors)
    assert bad.read_text() == json.dumps({"runs": []})  # nothing written


def _batch(seeds):
    runs = [{"method": m, "seed": s, **_result(k, s)} for k, m in enumerate(["sgd", "swag"]) for s in seeds]
    compare = {"reference": "sgd", "seeds": list(seeds), "methods": [{"name": "sgd"}, {"name": "swag"}]}
    config = {"seed": 0, "output_dir": f"runs/s{min(seeds)}", "compare": {"seeds": list(seeds), "reference": "sgd"}}
    return {
        "config_hash": f"hash{min(seeds)}",  # covers output_dir and the seeds: differs between batches
        "config": config,
        "created": f"2024-01-0{1 + min(seeds)}T00:00:00",
        "compare": compare,
        "runs": runs,
    }


def test_refind_merges_seed_batches_into_the_findings_of_all_seeds(tmp_path):
    paths = []
    for seeds in ((0, 1), (2,)):
        path = tmp_path / f"batch{seeds[0]}" / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps(_batch(seeds)))
        paths.append(path)
    before = [p.read_bytes() for p in paths]
    refind = _script("refind")
    assert refind.main([*map(str, paths), "--out", str(tmp_path / "all")]) == 0
    assert [p.read_bytes() for p in paths] == before  # the batches are left as they were
    merged = json.loads((tmp_path / "all" / "results.json").read_text())
    whole = _batch(SEEDS)  # the same rows run as one comparison of seeds 0, 1, 2
    assert sorted(merged["runs"], key=lambda r: (r["method"], r["seed"])) == whole["runs"]
    assert merged["compare"]["seeds"] == list(SEEDS) and merged["created"] == "2024-01-03T00:00:00"
    assert merged["findings"] == findings({**whole, "runs": merged["runs"]})
    assert [(b["output_dir"], b["seeds"], b["config_hash"]) for b in merged["batches"]] == [
        ("runs/s0", [0, 1], "hash0"),
        ("runs/s2", [2], "hash2"),
    ]
    (swag,) = [c for c in merged["findings"]["comparisons"] if c["method"] == "swag" and c["metric"] == "accuracy"]
    assert swag["n"] == 3


def test_refind_refuses_batches_that_are_not_one_study_in_one_line(tmp_path, capsys):
    refind = _script("refind")

    def write(name, results):
        path = tmp_path / name
        path.write_text(json.dumps(results))
        return str(path)

    a = write("a.json", _batch((0, 1)))
    out = str(tmp_path / "o")
    changed = _batch((2,))
    changed["config"]["seed"] = 1  # another study's config, not only another batch's folder and seeds
    assert refind.main([a, write("b.json", changed), "--out", out]) == 2
    other = _batch((2,))
    other["compare"]["reference"] = "swag"
    assert refind.main([a, write("c.json", other), "--out", out]) == 2
    assert refind.main([a, write("d.json", _batch((1, 2))), "--out", out]) == 2  # seed 1 twice
    assert refind.main([a, write("e.json", _batch((2,)))]) == 2  # no --out
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 4 and all(e.startswith("refind: error: ") for e in errors)
    assert "another config" in errors[0] and "beyond its seeds" in errors[1] and "seed 1" in errors[2]
    assert not (tmp_path / "o").exists()


def test_study_acts_finds_the_radius_study_anchored_and_the_regimes_control_failed(capsys):
    """The two facts issue #34 read from the committed studies: the radius study's q moved a few nats (KL weight 1
    to a prior equal to its start), and the authors'-regime Gaussian missed SGD's interval."""
    acts = _script("study_acts")
    assert acts.main([str(ROOT / "docs/fpbma-study/radius/results.json")]) == 0
    out = capsys.readouterr().out
    assert "| lowrank-vi | 5 | 1.53 [0.821, 2.15] |" in out
    assert "moved no more than 50 nats on some seed: lowrank-vi (0.821)" in out
    regimes = ROOT / "docs/fpbma-study/regimes/results.json"
    assert acts.main([str(regimes), "--control", "lowrank-vi", "sgd"]) == 0
    out = capsys.readouterr().out
    mean = statistics.mean(
        r["accuracy"] for r in json.loads(regimes.read_text())["runs"] if r["method"] == "lowrank-vi"
    )
    assert f"lowrank-vi's accuracy {mean:.4f} < the low end of sgd's 95% interval" in out and out.endswith("NOT met\n")
    assert "q moved more than 50 nats on every seed of every variational arm" in out
    assert "| lowrank-vi | 5 | 6.68e+04 [2.17e+04, 4.93e+05] | 0.0099 [0.00969, 0.0108] | 0.99 [0.969, 1.08] |" in out


def test_study_acts_gives_no_init_std_ratio_to_an_arm_started_at_its_prior_fit(capsys):
    """A q started at its prior stage's fit (prior.init, σ floored at prior.min_std) never had init_std as its σ:
    the transfer study's low-rank VI ended at median σ 0.0098, which read as "9.78× init_std" though it started at
    σ ≥ 0.01/√2. MFVI, started at init_std, keeps its ratio."""
    acts = _script("study_acts")
    assert acts.main([str(ROOT / "docs/claims-study/transfer/results.json")]) == 0
    out = capsys.readouterr().out
    assert "| lowrank-vi | 10 | 2.41e+05 [1.79e+05, 6.55e+05] | 0.00978 [0.00884, 0.0141] | — |" in out
    assert "| mfvi | 10 | — | 0.0013 [0.0013, 0.0013] | 1.3 [1.3, 1.3] |" in out


def test_study_acts_refuses_what_is_not_a_results_json_in_one_line(tmp_path, capsys):
    acts = _script("study_acts")
    (tmp_path / "r.json").write_text("{}")
    assert acts.main([str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_claims_tables_are_the_tables_of_the_claims_page(capsys):
    """docs/studies/claims.md's verdict tables are `scripts/claims_tables.py`'s output on the committed results,
    verbatim: a number on the page is the report's own, and the page cannot drift from its results.json."""
    script = _script("claims_tables")
    results = json.loads((ROOT / "docs/claims-study/scratch/results.json").read_text())
    fpbma, flat = script.tables(results)
    page = (ROOT / "docs/studies/claims.md").read_text()
    assert fpbma in page and flat in page
    assert len(fpbma.splitlines()) == 2 + 4 and len(flat.splitlines()) == 2 + 6  # 4 FP-BMA pairs, 6 F-X − X pairs
    assert "| f-mfvi − mfvi | **+0.0038 [0.0014, 0.0062]** | **−0.0259 [−0.0282, −0.0235]** |" in flat
    assert "(δ₈₀ 0.0054)" in fpbma  # a null with the difference it could have detected
    assert script.main([str(ROOT / "docs/claims-study/scratch/results.json")]) == 0
    assert capsys.readouterr().out.count("| pair |") == 2


def test_the_transfer_settings_tables_and_their_sensitivity_are_on_the_claims_page(capsys):
    """The transfer setting's tables, over every seed and without the rows the health rules flag, are the script's
    output verbatim; the sensitivity drops exactly the flagged seeds of each pair (seed 5 of the Gaussian arms, and
    seed 9 of the score arm), so its FP-BMA rows differ and its F-X − X rows without a flagged run do not."""
    script = _script("claims_tables")
    path = ROOT / "docs/claims-study/transfer/results.json"
    results = json.loads(path.read_text())
    page = (ROOT / "docs/studies/claims.md").read_text()
    fpbma, flat = script.tables(results)
    clean_fpbma, clean_flat = script.tables(results, without_flagged=True)
    for table in (fpbma, flat, clean_fpbma, clean_flat):
        assert table in page
    assert len(fpbma.splitlines()) == 2 + 4 and len(flat.splitlines()) == 2 + 6
    flagged = {(r["method"], r["seed"]) for r in results["runs"] if r.get("health", {}).get("ok") is False}
    assert flagged == {
        *(
            (m, 5)
            for m in ("lowrank-vi", "fp-bma-r0.05", "fp-bma-score0.5", "twin@fp-bma-r0.05", "twin@fp-bma-score0.5")
        ),
        ("fp-bma-score0.5", 9),
    }
    assert set(fpbma.splitlines()[2:]).isdisjoint(clean_fpbma.splitlines()[2:])  # every FP-BMA pair lost a seed
    untouched = [line for line in flat.splitlines()[2:] if not line.startswith("| f-lowrank-vi")]
    assert set(untouched) <= set(clean_flat.splitlines())
    assert "| f-mfvi − mfvi | +0.010 [−0.002, 0.022] (δ₈₀ 0.017) | **−0.090 [−0.128, −0.053]** |" in flat
    assert script.main([str(path), "--without-flagged"]) == 0
    assert "over common seeds whose rows no health rule flags" in capsys.readouterr().out


def test_claims_tables_refuses_results_without_pairs_in_one_line(tmp_path, capsys):
    script = _script("claims_tables")
    (tmp_path / "r.json").write_text("{}")
    assert script.main([str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no paired differences (findings.pairs)" in err
