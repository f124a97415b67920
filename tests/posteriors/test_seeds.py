"""The seeds the posteriors derive (:mod:`flatbma.rng`): SplitMix64, seeded generators, forked RNG."""

import torch

from flatbma.rng import SEED_BOUND, forked_rng, new_seed, seeded_generator, splitmix64


def test_splitmix64_matches_the_reference_generator():
    # Vigna's splitmix64.c: the n-th output of the generator seeded with s is splitmix64(s, n)
    assert [splitmix64(1234567, i) for i in range(3)] == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert splitmix64(0, 0) == 0xE220A8397B1DCDAF
    assert splitmix64(0, -1) == 0  # stream -1 (initialization) mixes the seed itself
    assert all(0 <= splitmix64(s, i) < 2**64 for s in (0, 1, 2**62) for i in (-1, 0, 7))


def test_seeded_generator_draws_from_the_low_63_bits():
    seed, stream = 2**61 + 12345, 17
    expected = torch.Generator().manual_seed(splitmix64(seed, stream) & (2**63 - 1))
    a = torch.randn(5, generator=seeded_generator(torch.tensor(seed), stream, "cpu"))
    assert torch.equal(a, torch.randn(5, generator=expected))
    b = torch.randn(5, generator=seeded_generator(seed, stream + 1, "cpu"))
    assert not torch.equal(a, b)


def test_forked_rng_is_seeded_and_leaves_the_global_stream_alone():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with forked_rng(11):
        first = torch.rand(4)
    with forked_rng(11):
        again = torch.rand(4)
    assert torch.equal(first, again) and torch.equal(torch.get_rng_state(), before)
    seed = new_seed()
    assert seed.dtype == torch.int64 and seed.dim() == 0 and 0 <= int(seed) < SEED_BOUND
