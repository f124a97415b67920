"""Name-spaced state (optax's ``named_chain`` for flat tensor dicts)."""

from typing import NamedTuple

import pytest
import torch

from flatbma.errors import FlatbmaError
from flatbma.methods import METHODS
from flatbma.named import OPTIMIZER, chain, entries, names, nest, part, split, typed
from flatbma.optim.ascent import ASCENT
from flatbma.posteriors import bsam, ivon, laplace, point, sgld, swag
from flatbma.rng import SEED_KEY
from tests.helpers import train_steps


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


class _Typed(NamedTuple):
    mean: dict[str, torch.Tensor]
    ring: torch.Tensor | None
    count: torch.Tensor


def test_a_typed_state_lays_out_flat_by_its_field_names_and_reads_back_the_same_tensors():
    mean, ring, count = {"b": torch.zeros(2), "a": torch.ones(1)}, torch.zeros(3, 3), torch.tensor(4)
    flat = entries(_Typed(mean, ring, count))
    assert list(flat) == ["mean/b", "mean/a", "ring", "count"] and flat["ring"] is ring
    back = typed(_Typed, flat)
    assert back.mean == mean and back.mean["a"] is mean["a"] and back.ring is ring and back.count is count
    without_ring = entries(_Typed(mean, None, count))
    assert "ring" not in without_ring and typed(_Typed, without_ring).ring is None  # an optional field
    with pytest.raises(FlatbmaError, match="state entry 'extra' belongs to no field of _Typed"):
        typed(_Typed, {**flat, "extra": count})
    with pytest.raises(FlatbmaError, match="the state has no entry 'count': it is not a _Typed"):
        typed(_Typed, {"mean/a": count})


def _components(aux, where=""):
    """``(where, component, its entries)`` of ``aux``, descending into members and a composed method's point part."""
    for name in names(aux):
        own = part(name, aux)
        if name.startswith("member") or name == point.NAME:
            yield from _components(own, f"{where}{name}/")
        else:
            yield where, name, own


OWN = {
    swag.SWAG: swag.Moments,
    laplace.LAPLACE: laplace.Accumulated,
    sgld.NAME: sgld.Chain,
    ivon.NAME: ivon.Momentum,
    bsam.NAME: bsam.Momentum,
}
"""The families with state of their own: the component each keeps it under, and its typed state."""
SHARED = {OPTIMIZER, SEED_KEY.partition("/")[0], ASCENT}
"""The components any family may hold: its optimizer's state, its noise seed, its ascent step's memory."""


@pytest.mark.parametrize("name", list(METHODS))
def test_every_family_holds_shared_components_or_its_own_typed_state(name):
    """After training, each component of every registered method's ``aux`` is a shared one or reads as its typed
    state — the same tensors, every entry of it accounted for (``typed`` refuses a stray entry)."""
    _, state, _ = train_steps(name)
    seen = set()
    for where, component, own in _components(state.aux):
        assert component in SHARED | set(OWN), f"{name}: {where}{component}/ is neither shared nor a typed state"
        if component in OWN:
            flat = entries(typed(OWN[component], own))
            assert flat.keys() == own.keys() and all(flat[k] is own[k] for k in own)
            seen.add(component)
    own_of = {m: "swag" for m in ("swag", "swag-diag", "f-swag", "multiswag")} | {"laplace": "laplace"}
    own_of |= {"f-laplace": "laplace", "ivon": "ivon", "f-ivon": "ivon", "bsam": "bsam"}
    own_of |= {m: "sgld" for m in ("sgld", "csgld", "f-sgld")}
    assert seen == ({own_of[name]} if name in own_of else set())
