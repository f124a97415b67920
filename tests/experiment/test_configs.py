"""Every shipped config parses (compare configs with their compare section), and every command its comments show."""

import re
import shlex
from pathlib import Path

import pytest

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import load_config
from flatbma.experiment.run.validate import validate_runs
from flatbma.experiment.study.compare import _every_run
from flatbma.experiment.study.plan import load_plan

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses(path):
    cfg = load_config(path)
    assert cfg.method.name
    if "compare:" in path.read_text():
        plan = load_plan(path)
        # one row per (entry, seed); an entry with candidate lists trains several runs for its row
        assert len(plan.jobs()) == len(plan.compare.methods) * len(plan.compare.seeds)
        assert len(plan.runs()) == sum(len(job.candidates) for job in plan.jobs())
        if "  quick:" in path.read_text():
            assert load_plan(path, quick=True).compare.methods
        else:  # --quick without a compare.quick section would run the full study: refused (#23)
            with pytest.raises(FlatbmaError, match="sets none"):
                load_plan(path, quick=True)


_COMMAND = re.compile(r"^#\s+flatbma (train|compare) --config (\S+)(.*)$", re.MULTILINE)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_commands_in_a_config_s_comments_parse(path):
    """``[--set method.name=sgd]`` in digits-sam.yaml failed (sam's rho is no option of sgd) (#23)."""
    for command, config, rest in _COMMAND.findall(path.read_text()):
        words = shlex.split(rest.replace("[", " ").replace("]", " "))
        overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        assert Path(config).name == path.name
        if command == "train":
            load_config(path, overrides)
        else:
            load_plan(path, overrides, quick="--quick" in words)


@pytest.mark.parametrize(("name", "steps_per_epoch"), [("cifar10", 1), ("cifar100", 4)])
def test_the_cifar_configs_validate_without_cifar(name, steps_per_epoch, tmp_path):
    """Every run of the CIFAR configs passes the checks made before training, on data with their step count.

    CIFAR and the ResNet-18 weights are not in the repository: 10-shot digits (100 training images) stands in,
    in batches that give the CIFAR run's steps per epoch (100 or 1,000 images in batches of 256), so that the
    options counted in steps (SWAG's collection, cSGLD's cycles) are checked against the schedule they will see.
    """
    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}-resnet18-10shot.yaml"
    data = f"data={{name: digits, k_shot: 10, val_pool: 20, batch_size: {100 // steps_per_epoch}}}"
    plan = load_plan(path, [data, "model={name: cnn}", f"output_dir={tmp_path}"])
    validate_runs(_every_run(plan), flatness=plan.compare.flatness)
