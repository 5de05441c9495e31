"""A vLLM worker extension (``worker_extension_cls``) for weight sync.

vLLM mixes this class into every worker, so ``llm.collective_rpc("<method>", ...)``
runs it next to the model in each worker process (one per tensor-parallel rank).
Only a *file path* crosses the process boundary: the weights travel through a
safetensors file (tmpfs when available), which needs no pickle
(``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off) and works for any TP size because
``model.load_weights`` takes full HF-named tensors and shards them per rank.
On GPUs a CUDA-IPC or NCCL broadcast path would avoid the copy; not done here.
"""

from __future__ import annotations


class WeightSyncExtension:
    def emapg_load_weights_from_file(self, path: str) -> int:
        """Load HF-named tensors from ``path`` into the running model; returns #params updated."""
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        model = self.model_runner.model  # type: ignore[attr-defined]
        loaded = model.load_weights(weights=iter(weights.items()))
        return len(loaded) if loaded is not None else len(weights)
