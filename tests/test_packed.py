"""Packed tensor dicts (flatbma.packed): the flat fast paths compute exactly what the per-tensor paths do."""

import pytest
import torch

from flatbma import packed
from flatbma.experiment.run.checkpoint import save_state
from flatbma.gaussian import standard_normal_like
from flatbma.optim import SGD, Adam, FisherBall
from flatbma.params import Objective, add, detached, model_buffers, scale, trainable_params
from flatbma.posteriors import fp_bma, lowrank_vi
from tests.helpers import load_state, tiny_bn_net, toy_batch

SHAPES = {"conv.weight": (4, 3, 3, 3), "bn.weight": (4,), "bn.bias": (4,), "fc.weight": (5, 4), "fc.bias": (5,)}


def _tensors(seed: int = 0, shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _theta(seed: int = 0, k: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = {f"mean/{n}": torch.randn(s, generator=g) for n, s in SHAPES.items()}
    theta |= {f"log_std/{n}": torch.randn(s, generator=g) - 2 for n, s in SHAPES.items()}
    theta |= {f"factor/{n}": 0.1 * torch.randn((k, *s), generator=g) for n, s in SHAPES.items()}
    return theta


def test_pack_makes_views_of_one_buffer_and_detection_is_strict():
    tensors = _tensors()
    p = packed.pack(tensors)
    assert list(p) == list(tensors) and all(torch.equal(p[k], tensors[k]) for k in tensors)
    layout = packed.layout_of(p)
    flat = packed.flat_of(p)
    assert layout is not None and flat.shape == (sum(v.numel() for v in tensors.values()),)
    flat.mul_(2)  # the views see the buffer and the buffer sees the views
    assert torch.equal(p["fc.weight"], 2 * tensors["fc.weight"])
    p["bn.bias"].zero_()
    assert not flat[layout.offsets[2] : layout.offsets[2] + 4].any()
    # anything but exactly the layout's views in the layout's order is not packed
    assert packed.layout_of(dict(p)) == layout
    assert packed.layout_of(dict(reversed(list(p.items())))) is None
    assert packed.layout_of({k: v for k, v in p.items() if k != "bn.bias"}) is None
    assert packed.layout_of({**p, "bn.bias": p["bn.bias"].clone()}) is None
    assert packed.layout_of({k: v.clone() for k, v in p.items()}) is None
    assert packed.layout_of(tensors) is None and packed.flat_of(tensors) is None
    assert packed.layout_of(list(p.values()), list(p)) == layout
    assert packed.layout_of(list(p.values()), list(reversed(list(p)))) is None


def test_a_view_given_as_buffer_is_copied_so_the_views_know_their_buffer():
    tensors = _tensors()
    layout = packed.Layout.contiguous(tensors)
    big = torch.zeros(layout.numel + 3)
    views = layout.views(big[3:])
    assert packed.layout_of(views) == layout
    with pytest.raises(ValueError, match="does not hold a layout"):
        layout.views(big)


def test_packed_mapping_makes_views_only_when_asked():
    tensors = _tensors(1)
    layout = packed.Layout.contiguous(tensors)
    flat = torch.cat([v.reshape(-1) for v in tensors.values()])
    lazy = layout.lazy(flat)
    assert lazy._views is None
    assert len(lazy) == 5 and list(lazy) == list(tensors) and "fc.bias" in lazy and "nope" not in lazy
    assert packed.layout_of(lazy) is layout and packed.flat_of(lazy).data_ptr() == flat.data_ptr()
    assert lazy._views is None  # the fast paths never materialize
    assert torch.equal(lazy["conv.weight"], tensors["conv.weight"])
    assert packed.layout_of(dict(lazy)) == layout  # a plain dict of its views is still packed
    assert all(torch.equal(v, tensors[k]) for k, v in lazy.items())


def test_add_scale_and_detached_keep_packing_and_match_the_per_tensor_results():
    a, b = packed.pack(_tensors(2)), packed.pack(_tensors(3))
    b = packed.layout_of(a).views(packed.flat_of(b).clone())  # same layout object for both
    plain_a, plain_b = {k: v.clone() for k, v in a.items()}, {k: v.clone() for k, v in b.items()}
    fast, slow = add(a, b, 0.3), add(plain_a, plain_b, 0.3)
    assert isinstance(fast, packed.Packed) and not isinstance(slow, packed.Packed)
    assert all(torch.equal(fast[k], slow[k]) for k in slow)
    fast, slow = scale(a, -1.5), scale(plain_a, -1.5)
    assert isinstance(fast, packed.Packed) and all(torch.equal(fast[k], slow[k]) for k in slow)
    assert detached(fast) is fast and packed.layout_of(detached(a)) is not None


@pytest.mark.parametrize(
    "optimizer",
    [
        Adam(lr=1e-2, weight_decay=0.1),
        SGD(lr=0.1, momentum=0.9, weight_decay=1e-3),
        SGD(lr=0.1, momentum=0.9, nesterov=True),
        SGD(lr=0.1, momentum=0.0),
    ],
)
def test_optimizers_update_packed_state_as_one_tensor_with_identical_results(optimizer):
    start = _tensors(4)
    fast_params = packed.pack(start)
    slow_params = {k: v.clone() for k, v in start.items()}
    fast_state, slow_state = optimizer.init(fast_params), optimizer.init(slow_params)
    keys = list(start)
    for name in {k.partition("/")[0] for k in fast_state}:  # the moments are packed like the parameters
        assert packed.layout_of([fast_state[f"{name}/{k}"] for k in keys], keys) == packed.layout_of(fast_params)
    for step in range(4):
        grads = _tensors(10 + step)
        fast_grads = packed.layout_of(fast_params).lazy(torch.cat([g.reshape(-1) for g in grads.values()]))
        optimizer.apply(fast_params, fast_grads, fast_state, step)
        optimizer.apply(slow_params, grads, slow_state, step)
    assert all(torch.equal(fast_params[k], slow_params[k]) for k in keys)
    assert all(torch.equal(fast_state[k], slow_state[k]) for k in slow_state)
    assert packed.layout_of(fast_params) is not None  # updated in place: still the same views


def test_coalesce_falls_back_to_per_tensor_lists():
    p = packed.pack(_tensors())
    keys = list(p)
    other = packed.pack(_tensors(1))  # equal layout, another buffer
    flats = packed.coalesce(keys, p, other)
    assert [len(f) for f in flats] == [1, 1] and flats[1][0].data_ptr() == packed.flat_of(other).data_ptr()
    lists = packed.coalesce(keys, p, {k: v.clone() for k, v in p.items()})
    assert [len(x) for x in lists] == [5, 5] and lists[0][0] is p[keys[0]]


def test_pack_with_mirrors_packs_full_groups_only():
    params = _tensors()
    aux = {f"exp_avg/{k}": v + 1 for k, v in params.items()}
    aux |= {"momentum/bn.bias": torch.ones(4), "rng/seed": torch.tensor(3)}
    layout = packed.Layout.contiguous(params)
    new_params, new_aux = packed.pack_with_mirrors(params, aux, layout)
    keys = list(params)
    assert packed.layout_of(new_params) == layout
    assert packed.layout_of([new_aux[f"exp_avg/{k}"] for k in keys], keys) == layout
    assert new_aux["momentum/bn.bias"] is aux["momentum/bn.bias"] and new_aux["rng/seed"] is aux["rng/seed"]
    assert list(new_aux) == list(aux) and all(torch.equal(new_aux[k], aux[k]) for k in aux)
    # a group under a name of several segments (the optimizer's state under optimizer/: flatbma.named)
    nested = {f"optimizer/exp_avg/{k}": v + 1 for k, v in params.items()} | {
        "optimizer/momentum/bn.bias": torch.ones(4)
    }
    _, new_nested = packed.pack_with_mirrors(params, nested, layout)
    assert packed.layout_of([new_nested[f"optimizer/exp_avg/{k}"] for k in keys], keys) == layout
    assert new_nested["optimizer/momentum/bn.bias"] is nested["optimizer/momentum/bn.bias"]


def test_noise_drawn_into_one_buffer_equals_one_randn_per_tensor():
    like = {"a": torch.zeros(37), "b": torch.zeros(5, 3), "c": torch.zeros(16), "d": torch.zeros(2, 2, 2)}
    z = standard_normal_like(like, torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    reference = {k: torch.randn(v.shape, generator=g) for k, v in like.items()}
    assert packed.layout_of(z) is not None and all(torch.equal(z[k], reference[k]) for k in like)
    mixed = {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.float64)}  # not packable: per tensor
    z = standard_normal_like(mixed, torch.Generator().manual_seed(1))
    assert z["b"].dtype == torch.float64 and packed.layout_of(z) is None


def test_theta_layout_is_the_rows_matrix_of_mean_log_std_and_factor():
    theta = _theta()
    layout = lowrank_vi.theta_layout(theta)
    packed_theta = packed.pack(theta, layout)
    matrix = lowrank_vi.rows(packed_theta)
    assert matrix.shape == (3 + 2, sum(torch.Size(s).numel() for s in SHAPES.values()))
    assert matrix.data_ptr() == packed.flat_of(packed_theta).data_ptr()  # no copy
    torch.testing.assert_close(matrix, lowrank_vi.rows(theta), rtol=0, atol=0)
    for n in SHAPES:  # the factor's [K, *S] views stride over the rows
        assert torch.equal(packed_theta[f"factor/{n}"], theta[f"factor/{n}"])
    grads = lowrank_vi.from_rows(2 * matrix, theta)
    assert all(torch.equal(grads[k], 2 * theta[k]) for k in theta)


def test_fp_bma_state_is_packed_and_a_loaded_state_is_packed_again_with_the_same_trajectory(tmp_path):
    torch.manual_seed(0)
    model = tiny_bn_net().train()
    method = fp_bma.build(Objective(model=model, num_data=64), Adam(lr=1e-2), FisherBall(gamma=0.05), rank=3)
    state = method.init(trainable_params(model), model_buffers(model))
    keys = list(state.params)
    assert packed.layout_of(state.params) is not None
    state, _ = method.update(state, toy_batch(seed=0))
    save_state(state, tmp_path / "s.safetensors")
    loaded = load_state(tmp_path / "s.safetensors")
    assert packed.layout_of(loaded.params) is None
    for seed in (1, 2):
        state, _ = method.update(state, toy_batch(seed=seed))
        loaded, _ = method.update(loaded, toy_batch(seed=seed))
    assert packed.layout_of(loaded.params) is not None
    assert packed.layout_of([loaded.aux[f"optimizer/exp_avg_sq/{k}"] for k in keys], keys) is not None
    assert all(torch.equal(state.params[k], loaded.params[k]) for k in keys)
    assert all(torch.equal(state.aux[k], loaded.aux[k]) for k in state.aux)


def test_noise_of_packed_and_unpacked_theta_is_the_same_draw():
    theta = _theta(5)
    family = lowrank_vi.LowRankGaussian(rank=3, init_std=0.1, prior_std=1.0)
    packed_theta = packed.pack(theta, lowrank_vi.theta_layout(theta))
    a = family.noise(theta, torch.Generator().manual_seed(4))
    b = family.noise(packed.as_packed(packed_theta), torch.Generator().manual_seed(4))
    assert list(a.z1) == list(b.z1) == sorted(SHAPES)
    assert all(torch.equal(a.z1[n], b.z1[n]) for n in SHAPES) and torch.equal(a.z2, b.z2)
    wa, wb = family.reparameterize(theta, a), family.reparameterize(packed_theta, b)
    assert all(torch.equal(wa[n], wb[n]) for n in SHAPES)


def test_as_packed_wraps_a_packed_dict_without_copying():
    p = packed.pack(_tensors())
    view = packed.as_packed(p)
    assert isinstance(view, packed.Packed) and view._views is not None
    assert all(view[k] is p[k] for k in p) and packed.flat_of(view).data_ptr() == packed.flat_of(p).data_ptr()
    plain = _tensors()
    assert packed.as_packed(plain) is plain and packed.as_packed(view) is view
