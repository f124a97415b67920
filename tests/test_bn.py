import torch

from flatbma.bn import has_batchnorm, recompute_bn_statistics
from tests.helpers import tiny_bn_net, toy_batch


def test_recomputed_statistics_are_the_exact_epoch_average():
    torch.manual_seed(0)
    net = tiny_bn_net()
    assert has_batchnorm(net)
    batches = [toy_batch(n=8, seed=s) for s in range(3)]
    weights = {k: v.detach() + 0.1 for k, v in net.named_parameters()}
    out = recompute_bn_statistics(net, weights, batches)
    # reference: hidden pre-activations of the first Linear with the sampled weights
    h = [torch.nn.functional.linear(x, weights["0.weight"], weights["0.bias"]) for x, _ in batches]
    means = torch.stack([b.mean(0) for b in h])
    vars_ = torch.stack([b.var(0, unbiased=True) for b in h])
    torch.testing.assert_close(out["1.running_mean"], means.mean(0))
    torch.testing.assert_close(out["1.running_var"], vars_.mean(0))
    assert int(out["1.num_batches_tracked"]) == 3
    # the template keeps its own statistics and mode
    assert torch.equal(net[1].running_mean, torch.zeros(8)) and net[1].momentum == 0.1


def test_unequal_batches_are_weighted_by_their_sizes():
    """Batches of 3 and 9 examples: the statistics are the size-weighted averages of the batch statistics."""
    torch.manual_seed(0)
    net = tiny_bn_net()
    x, y = toy_batch(n=12, seed=4)
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]
    weights = {k: v.detach() for k, v in net.named_parameters()}
    out = recompute_bn_statistics(net, weights, batches)
    h = [torch.nn.functional.linear(b, weights["0.weight"], weights["0.bias"]) for b, _ in batches]
    mean = (3 * h[0].mean(0) + 9 * h[1].mean(0)) / 12
    var = (3 * h[0].var(0, unbiased=True) + 9 * h[1].var(0, unbiased=True)) / 12
    torch.testing.assert_close(out["1.running_mean"], mean)
    torch.testing.assert_close(out["1.running_var"], var)
    # one batch of everything: the statistics of all the data
    whole = recompute_bn_statistics(net, weights, [(x, y)])
    full = torch.nn.functional.linear(x, weights["0.weight"], weights["0.bias"])
    torch.testing.assert_close(whole["1.running_mean"], full.mean(0))
    torch.testing.assert_close(whole["1.running_var"], full.var(0, unbiased=True))


def test_dropout_is_off_while_statistics_are_recomputed():
    """A dropout network (dropout before BatchNorm, as in MC dropout) gets the statistics of its
    deterministic forward pass, whatever mode the model is in and whatever the RNG state."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(8))
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Identity(), torch.nn.BatchNorm1d(8))
    plain.load_state_dict(net.state_dict())
    batches = [toy_batch(n=16, seed=s) for s in range(2)]
    weights = {k: v.detach() for k, v in net.named_parameters()}
    net.train()
    torch.manual_seed(1)
    a = recompute_bn_statistics(net, weights, batches)
    torch.manual_seed(2)
    b = recompute_bn_statistics(net, weights, batches)
    reference = recompute_bn_statistics(plain, weights, batches)
    for key in ("2.running_mean", "2.running_var"):
        assert torch.equal(a[key], b[key])
        torch.testing.assert_close(a[key], reference[key])
    assert net.training and net[1].training and net[2].training  # modes restored
