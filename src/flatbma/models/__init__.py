"""Models: tiny CPU models, ResNet-18 and MobileNetV2 with torchvision names, and a name registry.

Every model ends in an ``nn.Linear`` classifier found by :func:`classifier_of`; pretrained weights
are read only as plain tensors (``torch.load(weights_only=True)`` or safetensors).
"""

from flatbma.models.checkpoint import StateDict, copied, is_pretrained, load_matching, load_state_dict_file
from flatbma.models.contract import check_classifier, keep_logits, logits_of, returns_sequence
from flatbma.models.heads import classifier_of, replace_classifier, seeded
from flatbma.models.mobilenet import (
    InvertedResidual,
    MobileNetV2,
    imagenet_weights_path,
    load_pretrained_mobilenet_v2,
    make_divisible,
    mobilenet_v2,
)
from flatbma.models.registry import build_model, model_names
from flatbma.models.resnet import BasicBlock, ResNet, resnet18
from flatbma.models.small import MLP, SmallCNN

__all__ = [
    "MLP",
    "BasicBlock",
    "InvertedResidual",
    "MobileNetV2",
    "ResNet",
    "SmallCNN",
    "StateDict",
    "build_model",
    "check_classifier",
    "classifier_of",
    "copied",
    "imagenet_weights_path",
    "is_pretrained",
    "keep_logits",
    "load_matching",
    "load_pretrained_mobilenet_v2",
    "load_state_dict_file",
    "logits_of",
    "make_divisible",
    "mobilenet_v2",
    "model_names",
    "replace_classifier",
    "resnet18",
    "returns_sequence",
    "seeded",
]
