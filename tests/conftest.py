"""Shared test settings.

Tests marked ``cuda`` prove CUDA behaviour and run only where a GPU is present (on the
device machine, through ``scripts/gpu_check.sh``); everywhere else they are skipped
with that reason, never faked.
"""

import os

# One intra-op thread: CI machines have two cores, and torch's default pool thrashes
# on the many tiny ops of the CPU-backend pipeline tests (minutes instead of seconds).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_capture_left_underway(request):
    """After each CUDA test, nothing in the process is still capturing or routing its
    allocations to a pool. One left open (a thread's recording never ended, a pool's
    routing never ended) makes every later emptying of the cache fail, and aborts the
    process at the next ``torch.cuda.MemPool`` destroyed (an assertion in its destructor):
    tests much later die with no sign of the cause. Here the test that left it fails."""
    yield
    if "cuda" not in request.keywords or not _cuda_available():
        return
    import torch

    torch.cuda.synchronize()
    try:
        torch.cuda.empty_cache()
    except RuntimeError as err:
        pytest.fail(f"a CUDA capture or pool routing is still open after this test: {err}", pytrace=False)
