"""Name-spaced state (optax's ``named_chain`` for flat tensor dicts) and reading a state of the layout before it."""

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.named import chain, names, nest, part, split
from flatbma.state_io import renamed, structure_problem
from flatbma.types import State


def test_each_component_keeps_its_entries_under_its_name_and_gets_the_same_tensors_back():
    momentum, mean, n = torch.ones(2), torch.zeros(2), torch.tensor(3)
    aux = chain(("point", {"momentum/w": momentum}), ("swag", {"mean/w": mean, "n_collected": n}))
    assert list(aux) == ["point/momentum/w", "swag/mean/w", "swag/n_collected"]
    own, moments = split(aux, "point", "swag")
    assert own == {"momentum/w": momentum} and own["momentum/w"] is momentum  # the same tensors, not copies
    assert moments.keys() == {"mean/w", "n_collected"} and moments["n_collected"] is n
    assert part("swag", aux) == moments and nest("swag", moments) == {k: v for k, v in aux.items() if "swag/" in k}
    assert names(aux) == ["point", "swag"] and part("poin", aux) == {}  # a name is a whole segment
    with pytest.raises(FlatbmaError, match="'amp/scale' belongs to none of the components point, swag"):
        split({**aux, "amp/scale": n}, "point", "swag")


def _state(aux):
    return State(params={"w": torch.zeros(2)}, aux=aux)


def test_a_state_of_the_layout_before_named_components_is_renamed_to_the_methods_layout():
    reference = _state({"point/momentum/w": torch.zeros(2), "swag/mean/w": torch.zeros(2)})
    old = _state({"momentum/w": torch.ones(2), "swag/mean/w": torch.full((2,), 2.0)})
    new = renamed(old, reference)
    assert list(new.aux) == ["point/momentum/w", "swag/mean/w"] and new.aux["point/momentum/w"] is old.aux["momentum/w"]
    assert structure_problem(new, reference) is None and structure_problem(old, reference) is not None
    assert renamed(new, reference) is new  # the current layout: untouched
    members = _state({"member0/point/momentum/w": torch.zeros(2), "member1/point/momentum/w": torch.zeros(2)})
    nested = renamed(_state({"member0/momentum/w": torch.ones(2), "member1/momentum/w": torch.ones(2)}), members)
    assert list(nested.aux) == ["member0/point/momentum/w", "member1/point/momentum/w"]
    # an entry the reference holds under its own name is never taken for another's
    both = _state({"point/momentum/w": torch.zeros(2), "momentum/w": torch.zeros(2)})
    assert renamed(_state({"momentum/w": torch.ones(2)}), both).aux.keys() == {"momentum/w"}


def test_an_entry_two_names_deeper_is_renamed_and_an_ambiguous_one_is_refused():
    """The optimizer's state moved under ``optimizer/`` inside SWAG's ``point/`` (#24): the oldest layout's
    ``momentum/w`` is two segments short of ``point/optimizer/momentum/w``; one segment short wins over two."""
    want = _state({"point/optimizer/momentum/w": torch.zeros(2), "laplace/curvature/diag/w": torch.zeros(2)})
    old = _state({"momentum/w": torch.ones(2), "laplace/diag/w": torch.full((2,), 2.0)})
    new = renamed(old, want)
    assert list(new.aux) == ["point/optimizer/momentum/w", "laplace/curvature/diag/w"]
    assert new.aux["point/optimizer/momentum/w"] is old.aux["momentum/w"] and structure_problem(new, want) is None
    between = _state({"point/momentum/w": torch.ones(2), "momentum/w": torch.full((2,), 3.0)})  # one short wins
    assert renamed(between, want).aux["point/optimizer/momentum/w"] is between.aux["point/momentum/w"]
    members = _state({f"member{m}/point/optimizer/momentum/w": torch.zeros(2) for m in range(2)})
    nested = renamed(_state({f"member{m}/momentum/w": torch.full((2,), float(m)) for m in range(2)}), members)
    assert [float(v[0]) for v in nested.aux.values()] == [0.0, 1.0] and list(nested.aux) == list(members.aux)
    # two entries as short as each other would both do: none is taken, the state is reported, never guessed
    ambiguous = _state({"point/momentum/w": torch.ones(2), "optimizer/momentum/w": torch.ones(2)})
    kept = renamed(ambiguous, want)
    assert kept.aux.keys() == ambiguous.aux.keys()
    assert structure_problem(kept, want) == "aux/point/optimizer/momentum/w is missing"
