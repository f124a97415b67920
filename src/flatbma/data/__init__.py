"""Datasets, few-shot sampling and image transforms.

Loaders read local files only and return :class:`DatasetSplits`; :func:`load_dataset` looks them up
by name in :data:`DATASETS`. :func:`few_shot` draws reproducible k-shot subsets whose validation
examples come out of the k-shot budget.
"""

from flatbma.data.datasets import (
    ANIMAL_MNIST_CLASSES,
    DATASETS,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_ROOT,
    ArrayDataset,
    DatasetSplits,
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
    "DATASETS",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ROOT",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ArrayDataset",
    "Compose",
    "DatasetSplits",
    "GrayscaleToRGB",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "Resize",
    "build_transform",
    "dataset_names",
    "few_shot",
    "few_shot_indices",
    "load_animal_mnist",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_idx",
    "load_image_folder",
    "stratified_split",
]
