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

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

#: each test's measured seconds (setup + call + teardown) on 2 cores, written by ``pytest --store-durations``: the order
#: the files run in (heaviest first), so that neither xdist worker is left alone with a long file at the end
DURATIONS = Path(__file__).with_name("durations.json")

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.retriever",
    "tests.fixtures.agent",
    "tests.fixtures.trainer",
    "tests.fixtures.toolcalls",
    "tests.fixtures.viewer",
    "tests.fixtures.coverage",
]


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write the seconds of each test that took {STORED_FROM_S} s or more to tests/{DURATIONS.name} "
                          "(tests not run keep theirs): the suite runs its files heaviest first by it")


def pytest_configure(config):
    # xdist's --dist loadfile hands out whole files in the collection order below (heaviest first): its default order
    # (files with the most tests first) left the few-test end-to-end files, the longest, for the end, one worker idle.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_StoreDurations(), "store-durations")


#: a test under this many seconds is not stored; one not in tests/durations.json counts 0.1 s
STORED_FROM_S = 0.5


class _StoreDurations:
    """``--store-durations`` on the controller (or a run without xdist): each test's setup + call + teardown seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        for nodeid, seconds in self.seconds.items():
            known.pop(nodeid, None)
            if seconds >= STORED_FROM_S:
                known[nodeid] = round(seconds, 1)
        DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")


def _file_order(items):
    """``items`` with their files heaviest first (the sum of their tests' :data:`DURATIONS`), each file's tests in their
    own order."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    weight: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        weight[path] = weight.get(path, 0.0) + known.get(item.nodeid, 0.1)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)
    return sorted(items, key=lambda it: (-weight[it.nodeid.split("::", 1)[0]], first[it.nodeid.split("::", 1)[0]]))


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: the weights are those of the tests that run
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
    items[:] = _file_order(items)


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
