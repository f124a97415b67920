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
