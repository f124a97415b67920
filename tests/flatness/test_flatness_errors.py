import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.flatness import hessian_eigenvalues, hessian_trace, hvp_fn, spectral_density


class TwoHeads(nn.Module):
    """``head`` is never used in the forward pass."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


BATCH = (torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2]))


def test_k_larger_than_the_number_of_parameters():
    with pytest.raises(FlatbmaError, match=r"k=16 .* only 15 parameters"):
        hessian_eigenvalues(TwoHeads(), BATCH, k=16, params=["body.weight", "body.bias"])


@pytest.mark.parametrize("data", [[], iter([]), [(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))]])
def test_empty_data(data):
    with pytest.raises(FlatbmaError, match="data for the Hessian is empty"):
        hessian_eigenvalues(TwoHeads(), data)


@pytest.mark.parametrize("fn", [hessian_eigenvalues, hessian_trace, spectral_density])
def test_parameters_without_a_gradient_path(fn):
    with pytest.raises(FlatbmaError, match=r"does not depend on any of the chosen parameters.*'head.weight'"):
        fn(TwoHeads(), BATCH, params=["head.weight", "head.bias"])


@pytest.mark.parametrize("hvp", ["double_backward", "func"])
def test_identically_zero_hessian(hvp):
    # the loss is linear in the bias: a gradient path exists but every Hessian-vector product is 0
    def loss_fn(logits, y):
        return logits.mean()

    with pytest.raises(FlatbmaError, match="identically zero"):
        hessian_eigenvalues(TwoHeads(), BATCH, k=1, loss_fn=loss_fn, params=["body.bias"], hvp=hvp)
    with pytest.raises(FlatbmaError, match="identically zero"):
        hessian_trace(TwoHeads(), BATCH, loss_fn=loss_fn, params=["body.bias"], hvp=hvp)


@pytest.mark.filterwarnings("ignore:the loss does not depend")
def test_bad_names_and_options():
    m = TwoHeads()
    with pytest.raises(FlatbmaError, match=r"'body.weigth' is not a parameter.*Did you mean 'body.weight'"):
        hvp_fn(m, BATCH, params=["body.weigth"])
    with pytest.raises(FlatbmaError, match="chosen twice"):
        hvp_fn(m, BATCH, params=["body.bias", "body.bias"])
    with pytest.raises(FlatbmaError, match="params is empty"):
        hvp_fn(m, BATCH, params=[])
    with pytest.raises(FlatbmaError, match="not the string"):
        hvp_fn(m, BATCH, params="body.bias")
    with pytest.raises(FlatbmaError, match="shape"):
        hvp_fn(m, BATCH, params={"body.bias": torch.zeros(4)})
    with pytest.raises(FlatbmaError, match=r"weights has a tensor 'body.bais'"):
        hvp_fn(m, BATCH, weights={"body.bais": torch.zeros(3)})
    with pytest.raises(FlatbmaError, match=r"hvp must be one of .*Did you mean 'func'"):
        hvp_fn(m, BATCH, hvp="funk")
    with pytest.raises(FlatbmaError, match="method must be one of"):
        hessian_eigenvalues(m, BATCH, method="arnoldi")
    with pytest.raises(FlatbmaError, match="k must be a positive integer"):
        hessian_eigenvalues(m, BATCH, k=0)
    with pytest.raises(FlatbmaError, match="tol must be > 0"):
        hessian_eigenvalues(m, BATCH, tol=0.0)
    with pytest.raises(FlatbmaError, match="max_iter must be >= k"):
        hessian_eigenvalues(m, BATCH, k=5, max_iter=3)
    with pytest.raises(FlatbmaError, match="num_samples must be an integer >= 2"):
        hessian_trace(m, BATCH, num_samples=1)
    with pytest.raises(FlatbmaError, match="pair"):
        hvp_fn(m, [(BATCH[0],)])
    with pytest.raises(FlatbmaError, match="data must be"):
        hvp_fn(m, BATCH[0])
    for p in m.parameters():
        p.requires_grad_(False)
    with pytest.raises(FlatbmaError, match="no trainable parameter"):
        hvp_fn(m, BATCH)
