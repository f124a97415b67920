"""Datasets, few-shot sampling and image transforms.

Loaders read local files only and return :class:`DatasetSplits`; :func:`load_dataset` looks them up by name in
:data:`DATASETS`. :func:`few_shot` draws reproducible k-shot subsets (validation out of the k-shot budget).
:func:`corrupt` applies the CIFAR-C corruptions to any images; :func:`load_cifar_c` reads the published files.
"""

from flatbma.data.cifar_c import (
    CIFAR10_CLASSES,
    CIFAR_C_CORRUPTIONS,
    cifar_c_corruptions,
    load_cifar_c,
)
from flatbma.data.corruptions import (
    BENCHMARK_CORRUPTIONS,
    CORRUPTIONS,
    SEVERITIES,
    applicable,
    corrupt,
    corrupt_dataset,
    corruption_names,
)
from flatbma.data.datasets import (
    ANIMAL_MNIST_CLASSES,
    DATASETS,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_ROOT,
    ArrayDataset,
    DatasetSplits,
    check_learnable,
    dataset_names,
    load_animal_mnist,
    load_cifar10,
    load_cifar100,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_idx,
    load_image_folder,
)
from flatbma.data.fewshot import few_shot, few_shot_indices, stratified_split
from flatbma.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Compose,
    GrayscaleToRGB,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    Resize,
    build_transform,
)

__all__ = [
    "ANIMAL_MNIST_CLASSES",
    "BENCHMARK_CORRUPTIONS",
    "CIFAR10_CLASSES",
    "CIFAR_C_CORRUPTIONS",
    "CORRUPTIONS",
    "DATASETS",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ROOT",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SEVERITIES",
    "ArrayDataset",
    "Compose",
    "DatasetSplits",
    "GrayscaleToRGB",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "Resize",
    "applicable",
    "build_transform",
    "check_learnable",
    "cifar_c_corruptions",
    "corrupt",
    "corrupt_dataset",
    "corruption_names",
    "dataset_names",
    "few_shot",
    "few_shot_indices",
    "load_animal_mnist",
    "load_cifar10",
    "load_cifar100",
    "load_cifar_c",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_idx",
    "load_image_folder",
    "stratified_split",
]
