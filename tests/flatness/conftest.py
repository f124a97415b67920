import pytest

from tests.flatness.problems import Problem, make_problem
from tests.helpers import one_thread


@pytest.fixture
def problem() -> Problem:
    return make_problem()


@pytest.fixture(autouse=True)
def _one_thread():
    """These problems are tiny: one thread avoids OpenMP overhead (and oversubscription on shared CI)."""
    with one_thread():
        yield
