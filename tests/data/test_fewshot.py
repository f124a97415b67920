import pytest
import torch

from flatbma.data import ArrayDataset, few_shot, few_shot_indices, stratified_split
from flatbma.errors import FlatbmaError

# Class sizes 7, 9, 5, 12, shuffled so that indices do not follow classes.
LABELS = torch.tensor([0] * 7 + [1] * 9 + [2] * 5 + [3] * 12)[
    torch.randperm(33, generator=torch.Generator().manual_seed(1))
]


def test_exactly_k_per_class_sorted_and_deterministic():
    train, val = few_shot_indices(LABELS, 4, seed=3)
    assert torch.bincount(LABELS[train], minlength=4).tolist() == [4, 4, 4, 4]
    assert val.numel() == 0 and val.dtype == torch.int64
    assert torch.equal(train, torch.sort(train).values) and train.unique().numel() == train.numel()
    again, _ = few_shot_indices(LABELS, 4, seed=3)
    assert torch.equal(train, again)
    others = {tuple(few_shot_indices(LABELS, 4, seed=s)[0].tolist()) for s in range(5)}
    assert len(others) == 5


def test_validation_comes_from_the_k_shot_budget():
    train, val = few_shot_indices(LABELS, 5, seed=0, val_per_class=2)
    assert torch.bincount(LABELS[train], minlength=4).tolist() == [3, 3, 3, 3]
    assert torch.bincount(LABELS[val], minlength=4).tolist() == [2, 2, 2, 2]
    assert not set(train.tolist()) & set(val.tolist())
    plain, _ = few_shot_indices(LABELS, 5, seed=0)
    assert sorted(train.tolist() + val.tolist()) == plain.tolist()


def test_k_shot_sets_are_nested_across_k():
    small, _ = few_shot_indices(LABELS, 2, seed=7)
    large, _ = few_shot_indices(LABELS, 5, seed=7)
    assert set(small.tolist()) <= set(large.tolist())


def test_k_larger_than_smallest_class_names_it():
    with pytest.raises(FlatbmaError, match=r"class 2 \('cat'\) has only 5 examples"):
        few_shot_indices(LABELS, 6, seed=0, class_names=["ant", "bee", "cat", "dog"])
    few_shot_indices(LABELS, 5, seed=0)


@pytest.mark.parametrize(
    ("k", "val", "message"), [(0, 0, "at least 1"), (3, 3, "val_per_class"), (3, -1, "val_per_class")]
)
def test_argument_errors(k, val, message):
    with pytest.raises(FlatbmaError, match=message):
        few_shot_indices(LABELS, k, seed=0, val_per_class=val)


def test_empty_class_is_an_error():
    with pytest.raises(FlatbmaError, match=r"class 4"):
        few_shot_indices(LABELS, 1, seed=0, num_classes=5)
    labels = torch.tensor([0, 0, 2, 2])
    with pytest.raises(FlatbmaError, match=r"no examples.*class 1"):
        few_shot_indices(labels, 1, seed=0)


def test_few_shot_on_dataset_uses_its_class_list():
    data = ArrayDataset(torch.zeros(33, 1, 2, 2), LABELS, ["ant", "bee", "cat", "dog"])
    train, val = few_shot(data, 3, seed=0, val_per_class=1)
    assert len(train) == 8 and val is not None and len(val) == 4 and train.classes == data.classes
    train, val = few_shot(data, 3, seed=0)
    assert len(train) == 12 and val is None
    wider = ArrayDataset(torch.zeros(33, 1, 2, 2), LABELS, ["ant", "bee", "cat", "dog", "eel"])
    with pytest.raises(FlatbmaError, match=r"class 4 \('eel'\)"):
        few_shot(wider, 1, seed=0)


def test_stratified_split_partitions_each_class():
    kept, held = stratified_split(LABELS, 0.2, 0)
    assert sorted(kept.tolist() + held.tolist()) == list(range(33))
    # round(0.2 * n) for class sizes 7, 9, 5, 12
    assert torch.bincount(LABELS[held], minlength=4).tolist() == [1, 2, 1, 2]
    assert torch.equal(held, stratified_split(LABELS, 0.2, 0)[1])
    assert not torch.equal(held, stratified_split(LABELS, 0.2, 1)[1])
    with pytest.raises(FlatbmaError, match=r"strictly between 0 and 1"):
        stratified_split(LABELS, 1.0, 0)
