import pytest

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import config_from_dict, load_config
from flatbma.optim import SAM, FisherSAM


def test_defaults_and_method_options_are_routed():
    cfg = config_from_dict({"method": {"name": "fsam", "rho": 0.2}, "optim": {"lr": 1}})
    assert cfg.method.ascent == FisherSAM(rho=0.2, eta=1.0)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.to_dict()["method"] == {"name": "fsam", "rho": 0.2, "eta": 1.0}
    assert config_from_dict({"method": "sgd"}).method.ascent is None


def test_roundtrip_of_resolved_config():
    cfg = config_from_dict({"method": {"name": "sam"}, "data": {"k_shot": 5}})
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": {"name": "sma"}}, "unknown method 'sma'. Did you mean 'sam'?"),
        ({"method": {"name": "sam", "roh": 0.1}}, "unknown config key 'method.roh' .*Did you mean 'rho'"),
        ({"method": {"name": "sgd"}, "optim": {"lrr": 0.1}}, "unknown config key 'optim.lrr'. Did you mean 'lr'"),
        ({"method": {"name": "sgd"}, "dat": {}}, "unknown config key 'dat'. Did you mean 'data'"),
        ({"method": {"name": "sgd"}, "train": {"epochs": 2.5}}, "train.epochs must be an integer"),
        ({"method": {"name": "sgd"}, "train": {"progress": "yes"}}, "train.progress must be true or false"),
        ({"method": {"name": "sam", "rho": -1}}, "method: rho must be a positive number"),
        ({"method": {"name": "sgd"}, "optim": {"lr": 0}}, "optim: lr must be > 0"),
        ({"method": {"name": "sgd"}, "optim": {"schedule": "cosin"}}, "Did you mean 'cosine'"),
        ({"data": {}}, "no 'method' section"),
        ({"method": {"name": "sgd"}, "model": {"dropout": 1.0}}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_bad_configs_give_actionable_errors(raw, message):
    with pytest.raises(FlatbmaError, match=message):
        config_from_dict(raw)


def test_set_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("method: {name: sam}\ntrain: {epochs: 3}\n")
    cfg = load_config(path, ["method.rho=0.3", "train.epochs=5", "data.root=null", "model.name=cnn"])
    assert cfg.method.ascent == SAM(rho=0.3)
    assert cfg.train.epochs == 5 and cfg.data.root is None and cfg.model.name == "cnn"
    with pytest.raises(FlatbmaError, match="--set expects key=value"):
        load_config(path, ["train.epochs"])


def test_unsafe_yaml_is_not_executed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("method: !!python/object/apply:os.system ['touch /tmp/flatbma_yaml_pwned']\n")
    with pytest.raises(FlatbmaError, match="not valid YAML"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(FlatbmaError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
