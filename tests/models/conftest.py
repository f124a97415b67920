from __future__ import annotations

import pytest
import torch

from flatbma.models import imagenet_weights_path


@pytest.fixture(scope="session")
def imagenet_state() -> dict[str, torch.Tensor]:
    """The shipped MobileNetV2 ImageNet checkpoint, read independently of flatbma's loader."""
    return torch.load(imagenet_weights_path(), map_location="cpu", weights_only=True)
