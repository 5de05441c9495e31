"""emapg.cpu: native bf16 is reported only where PyTorch's kernels may use it."""

from __future__ import annotations

from pathlib import Path

import pytest

from emapg import cpu


@pytest.mark.parametrize("capability", ["avx2", "default", "AVX2"])
def test_capped_kernels_report_no_native_bf16(monkeypatch, capability):
    """ATEN_CPU_CAPABILITY below AVX-512 makes bf16 matmuls fail ("pack_vnni2 ... avx512"): no native bf16 then,
    whatever /proc/cpuinfo says."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "flags : avx512f avx512_bf16 amx_bf16")
    assert cpu.cpu_has_bf16() is False


@pytest.mark.parametrize(("flags", "expected"), [("avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True), ("avx2 fma", False)])
def test_cpuinfo_flags_decide_without_a_cap(monkeypatch, flags, expected):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: f"processor : 0\nflags : {flags}\n")
    assert cpu.cpu_has_bf16() is expected
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")  # a cap at or above AVX-512 leaves the flags in charge
    assert cpu.cpu_has_bf16() is expected
