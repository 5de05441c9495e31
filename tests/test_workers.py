"""emapg.workers.WorkerPool: any importable function in killable worker processes, per-item deadlines."""

import os
import time

import pytest

from emapg.workers import WorkerPool, importable_name

_WARM = {"pid": None}


def warm_up() -> None:
    """Runs once in each new worker before it reports ready."""
    _WARM["pid"] = os.getpid()


def warmed_pid(_: int) -> int | None:
    return _WARM["pid"]


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def fail_to_start() -> None:
    raise SystemExit(5)


def divide(a: int, b: int) -> float:
    return a / b


def test_warmup_runs_in_every_worker_before_its_first_item():
    with WorkerPool(2, warmed_pid, warmup=warm_up) as pool:
        out = pool.map([(i,) for i in range(6)], timeout=30.0)
    pids = {value for kind, value in out}
    assert all(kind == "ok" for kind, _ in out) and None not in pids and os.getpid() not in pids
    assert 1 <= len(pids) <= 2  # the warm-up ran in the worker processes, not here


def test_results_keep_order_errors_and_timeouts_cost_one_item():
    with WorkerPool(2, divide) as pool:
        assert pool.map([(1, 2), (1, 0), (3, 1)], timeout=30.0) == [("ok", 0.5), ("error", "ZeroDivisionError: division by zero"), ("ok", 3.0)]
    with WorkerPool(1, nap) as pool:
        assert pool.map([(0.0,), (30.0,), (0.0,)], timeout=1.0) == [("ok", 0.0), ("timeout", None), ("ok", 0.0)]
        assert (pool.timeouts, pool.restarts) == (1, 1)


def test_a_worker_that_cannot_start_is_an_error_not_a_loop():
    with WorkerPool(1, nap, warmup=fail_to_start) as pool:
        with pytest.raises(RuntimeError, match="exited with code 5 during startup"):
            pool.map([(0.0,)], timeout=5.0)


def test_closed_pool_and_bad_tasks():
    pool = WorkerPool(1, nap)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.map([(0.0,)], timeout=1.0)
    assert importable_name(nap) == "tests.test_workers:nap"
    with pytest.raises(ValueError, match="module-level"):
        WorkerPool(1, nap, warmup=lambda: None)
