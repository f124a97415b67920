import copy
import re
from pathlib import Path

import torch

import flatbma
from flatbma import fit

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API_PAGE = ROOT / "docs" / "python-api.md"


def _python_api_blocks() -> list[str]:
    """The Python blocks of the docs' Python API page (up to its "Design" part), in order.

    The README shows the first of them verbatim (checked here, so the two cannot drift).
    """
    text = API_PAGE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text[: text.index("## Design\n")], flags=re.S)
    readme = README.read_text()
    shown = re.findall(r"```python\n(.*?)```", readme[readme.index("## Python API\n") :], flags=re.S)
    assert shown and shown[0] == blocks[0], "README's Python block differs from docs/python-api.md's first"
    return blocks


def test_readme_python_api_runs_verbatim_and_its_numbers_hold(tmp_path, monkeypatch, capsys):
    """The one-call block, the manual block and the SAM snippet run as written, in one namespace.

    Checked: fit_posterior wrote the posterior mean into the module (load_into); the BMA beats the
    untrained module on the test set; the predictor equals the careful manual path (same samples, same
    BatchNorm statistics, same metrics and probabilities).
    """
    monkeypatch.chdir(tmp_path)  # the example saves a file
    untrained = []

    def recording(model, *args, **kwargs):  # fit_posterior, keeping a copy of the module it was given
        untrained.append(copy.deepcopy(model))
        return fit.fit_posterior(model, *args, **kwargs)

    monkeypatch.setattr(flatbma, "fit_posterior", recording)
    blocks = _python_api_blocks()
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert "accuracy" in capsys.readouterr().out
    bma, test_loader = namespace["bma"], namespace["test_loader"]
    (before,) = untrained

    # the module holds the posterior mean, not the weights it started with
    mean, weights = bma.mean(), {**dict(bma.model.named_parameters()), **dict(bma.model.named_buffers())}
    assert all(torch.equal(weights[k], v) for k, v in mean.items())
    assert not torch.equal(weights["0.weight"], dict(before.named_parameters())["0.weight"])
    assert (tmp_path / "swag.safetensors").is_file()

    # the BMA beats the untrained module
    start = {**dict(before.named_parameters()), **dict(before.named_buffers())}
    baseline = flatbma.evaluate(before, [start], test_loader, num_classes=3)
    metrics = namespace["metrics"]
    assert metrics["nll"] < baseline["nll"] - 0.5 and metrics["accuracy"] > baseline["accuracy"] + 0.3

    # predictor == the manual path: same samples, same statistics, same numbers
    manual_samples = namespace["samples"]
    assert len(manual_samples) == len(bma.samples) == 30
    for ours, theirs in zip(bma.samples, manual_samples):
        assert ours.keys() == theirs.keys()
        for k in ours:
            torch.testing.assert_close(ours[k], theirs[k], rtol=1e-6, atol=1e-6)
    for key, value in namespace["manual"].items():
        assert abs(metrics[key] - value) <= 1e-6, key
    x_test = namespace["x"][768:]
    manual_model = namespace["model"]
    manual_model.eval()
    reference = flatbma.bma_log_probs(manual_model, manual_samples, x_test).exp()
    torch.testing.assert_close(namespace["probs"], reference, rtol=1e-6, atol=1e-6)

    # flatness with explicit weights: at the mean and per sample
    top5, lambda1 = namespace["top5"], namespace["lambda1"]
    assert top5.shape == (5,) and bool((top5[:-1] >= top5[1:]).all()) and top5[0] > 0
    assert len(lambda1) == 4 and all(v > 0 for v in lambda1)


def test_readme_quick_start_names_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
