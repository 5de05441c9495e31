"""The EMA-PG / GRPO math: pure torch functions and the registered KL kinds, importing nothing of the run.

This package's ``__init__`` imports no torch: the configs read their defaults from it.
"""

#: Tokens per chunk of the fused lm_head passes (also ``model.chunk_size``'s default).  1024 tokens × 151,936
#: (Qwen vocab) × 4 B ≈ 0.6 GiB per chunk temporary; smaller chunks use less memory but stream the (V, H)
#: lm_head weight more often (slower on a CPU, see ``benchmarks/kl_memory.py``).
DEFAULT_CHUNK_SIZE = 1024
