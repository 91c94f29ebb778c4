"""The `slow` marker: tests that start several processes (gloo ranks, torchrun) or run the GPU
benchmarks' CPU smoke tests. CI runs everything (`python -m pytest`); a newcomer's quick check
is `python -m pytest -m "not slow" -n 2` (README). A test is slow when its module is listed
below or its own code starts ranks (calls run_ranks or torchrun), so a new multi-process test
is marked by itself."""

from __future__ import annotations

import inspect

import pytest
import torch

SLOW_MODULES = {"test_bench_smoke", "test_bench_data_smoke", "test_checkpoint_kill",
                "test_torchrun_faults", "test_train_pipeline", "test_train_parallel"}
STARTS_RANKS = ("run_ranks(", "torchrun(", "torch.distributed.run")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: starts several processes or smoke-tests a benchmark (CI runs it; "
        "-m 'not slow' leaves it out)")


def _starts_ranks(item: pytest.Item) -> bool:
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError, AttributeError):
        return False
    return any(marker in source for marker in STARTS_RANKS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        if module in SLOW_MODULES or _starts_ranks(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures(...)`): tiny
    matmuls, or a server, its engine and client threads in one process, run faster than with
    several threads fighting over shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
