from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flatbma.errors import FlatbmaError
from flatbma.models import (
    SmallCNN,
    build_model,
    load_matching,
    load_pretrained_mobilenet_v2,
    load_state_dict_file,
)


class _Exploit:
    """Unpickling this object runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_malicious_pickle_is_refused_and_not_executed(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    payload = {"features.0.0.weight": torch.zeros(1), "x": _Exploit(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with path.open("wb") as f:
            pickle.dump(payload, f)
    with pytest.raises(FlatbmaError, match="refused to load") as info:
        load_state_dict_file(path)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(FlatbmaError):
        load_pretrained_mobilenet_v2(10, path)
    with pytest.raises(FlatbmaError):
        build_model("resnet18", num_classes=10, in_channels=3, image_size=32, pretrained=path)
    assert not marker.exists()
    # Positive control: the payload is live — unrestricted unpickling would have run the command.
    if writer == "pickle":
        pickle.loads(path.read_bytes())
    else:
        torch.load(path, weights_only=False)
    assert marker.exists()


def test_pickled_module_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pth"
    torch.save(SmallCNN(1, 2, width=2), path)
    with pytest.raises(FlatbmaError, match="refused to load"):
        load_state_dict_file(path)


def test_non_mapping_and_non_tensor_entries(tmp_path: Path) -> None:
    path = tmp_path / "list.pth"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(FlatbmaError, match="not a state dict"):
        load_state_dict_file(path)
    torch.save({"a": torch.zeros(1), "b": 3}, path)
    with pytest.raises(FlatbmaError, match="'b': int"):
        load_state_dict_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FlatbmaError, match="does not exist"):
        load_state_dict_file(tmp_path / "nope.pth")


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.pth"
    path.write_text("not a checkpoint")
    with pytest.raises(FlatbmaError, match="refused to load"):
        load_state_dict_file(path)
    bad = tmp_path / "garbage.safetensors"
    bad.write_text("not a checkpoint")
    with pytest.raises(FlatbmaError, match="safetensors"):
        load_state_dict_file(bad)


def test_wrapped_and_data_parallel_checkpoints_are_unwrapped(tmp_path: Path) -> None:
    state = SmallCNN(1, 2, width=2).state_dict()
    path = tmp_path / "ckpt.pth"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    loaded = load_state_dict_file(path)
    assert list(loaded) == list(state)


def test_safetensors_roundtrip(tmp_path: Path) -> None:
    state = SmallCNN(1, 2, width=2).state_dict()
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    loaded = load_state_dict_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_load_matching_reinitializes_only_a_head_of_other_shape() -> None:
    source = SmallCNN(1, 5, width=2)
    target = SmallCNN(1, 3, width=2)
    assert load_matching(target, source.state_dict(), source="mem", head="classifier")
    assert torch.equal(target.features[0][0].weight, source.features[0][0].weight)
    assert target.classifier.weight.shape == (3, 8)
    with pytest.raises(FlatbmaError, match=r"shape mismatches \[features\.0\.0\.weight"):
        load_matching(SmallCNN(1, 5, width=4), source.state_dict(), source="mem", head="classifier")
