import pytest
import torch

from tests.flatness.problems import Problem, make_problem


@pytest.fixture
def problem() -> Problem:
    return make_problem()


@pytest.fixture(autouse=True)
def _one_thread():
    """These problems are tiny: one thread avoids OpenMP overhead (and oversubscription on shared CI)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
