"""What this CPU can do that changes how we compute."""

from __future__ import annotations

import os
from pathlib import Path


def aten_kernels_below_avx512() -> bool:
    """Whether ``ATEN_CPU_CAPABILITY`` caps PyTorch's CPU kernels below AVX-512 (``default``, ``avx2``, ...). On a CPU
    with AVX512-BF16 or AMX some bf16 kernels still pick their AVX-512 paths from the CPU's flags and then stop with
    "pack_vnni2 is only supported when avx512 is supported" (seen: bf16 matmuls, and the fused CPU attention of
    ``scaled_dot_product_attention`` on longer sequences)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() in ("default", "avx2", "avx", "sse", "none")


def cpu_has_bf16() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX-BF16): there bf16 matrix products run faster than fp32
    (the encoder's bf16 index build, the trainer's ``run.precision=bf16`` on CPU); elsewhere bf16 is emulated and
    slower. Linux reads ``/proc/cpuinfo``; elsewhere oneDNN is asked. False also where ``ATEN_CPU_CAPABILITY`` caps
    PyTorch's kernels below AVX-512 (``default``, ``avx2``): there its bf16 matrix products stop with "pack_vnni2 is
    only supported when avx512 is supported" (the test suite sets ``avx2`` for bit-exact golden files)."""
    if aten_kernels_below_avx512():
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        try:
            import torch

            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except Exception:  # noqa: BLE001 -- no oneDNN: no native bf16
            return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
