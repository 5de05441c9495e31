"""Shared pytest setup. Fixture modules live in tests/fixtures/ (one per area)."""

import os

# Offline, quiet and polite to a 2-core machine: several heavy processes share it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# One set of CPU kernels whatever the host: torch picks AVX-512 kernels where the CPU has them, and
# their float rounding differs from the AVX2 ones the golden runs (tests/trainer/test_golden.py) were
# recorded with (CI hosts vary: both kinds seen). Must be set before torch is first imported.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
# The same for MKL's matrix products (torch's CPU BLAS): MKL picks its code path by CPU too (AVX-512, and
# others on AMX hosts), and AdamW turns rounding-sized gradient differences into lr-sized weight differences
# (see tests/trainer/test_golden.py). MKL's conditional numerical reproducibility pins the AVX2 path.
os.environ.setdefault("MKL_CBWR", "AVX2")

import pytest  # noqa: E402

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.retriever",
    "tests.fixtures.agent",
    "tests.fixtures.trainer",
    "tests.fixtures.toolcalls",
    "tests.fixtures.viewer",
    "tests.fixtures.coverage",
]


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _ieee_subnormals_after_each_test():
    """A test that sets up a Trainer without closing it leaves ``run.flush_denormal`` on in its worker's thread; the next
    test in that worker (hypothesis' float strategies refuse to run then) gets IEEE subnormals back. The Trainer itself
    puts the flush back on close (tests/trainer/test_numerics.py)."""
    yield
    import torch

    from trainer.policy import flush_denormal_on

    if flush_denormal_on():
        torch.set_flush_denormal(False)
