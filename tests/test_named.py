"""Name-spaced state (optax's ``named_chain`` for flat tensor dicts)."""

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.named import chain, names, nest, part, split


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
