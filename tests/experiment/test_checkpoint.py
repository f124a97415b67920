import os
import pickle

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.experiment.checkpoint import load_state, save_state
from flatbma.types import State


def _state():
    return State(
        params={"fc.weight": torch.randn(3, 2), "fc.bias": torch.zeros(3)},
        buffers={"bn.running_mean": torch.ones(4), "bn.num_batches_tracked": torch.tensor(7)},
        aux={"momentum/fc.weight": torch.randn(3, 2)},
        step=12,
    )


def test_round_trip_is_exact(tmp_path):
    s = _state()
    save_state(s, tmp_path / "c.safetensors")
    t = load_state(tmp_path / "c.safetensors")
    assert t.step == 12
    for section in ("params", "buffers", "aux"):
        a, b = getattr(s, section), getattr(t, section)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_state(_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FlatbmaError, match="truncated or corrupted"):
        load_state(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/flatbma_pwned",))


def test_pickle_disguised_as_checkpoint_is_refused_and_not_executed(tmp_path):
    path = tmp_path / "c.safetensors"
    path.write_bytes(pickle.dumps({"x": _Evil()}))
    with pytest.raises(FlatbmaError):
        load_state(path)
    assert not os.path.exists("/tmp/flatbma_pwned")


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FlatbmaError, match="does not exist"):
        load_state(tmp_path / "nope.safetensors")


def test_key_order_survives_a_round_trip(tmp_path):
    s = State(params={"z": torch.ones(1), "a": torch.zeros(1), "m": torch.ones(2)}, step=1)
    save_state(s, tmp_path / "c.safetensors")
    assert list(load_state(tmp_path / "c.safetensors").params) == ["z", "a", "m"]
