"""The transformers fallback engine: batched incremental decoding with a KV cache.

Why not ``model.generate``: we need (a) per-sequence seeds, so a trajectory's sample
does not depend on its batch mates, (b) stop strings that end *each* sequence at the
token that completes the string, and (c) log-probs under the processed sampling
distribution with the same definition as vLLM's. A 60-line decoding loop over the
model's forward with a ``DynamicCache`` gives all three; finished rows are dropped
from the batch (and the cache) so they cost nothing.

Prompts are left-padded; position ids are computed from the attention mask, so a
padded row produces the same logits as the row alone (up to float rounding).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from agent.engines.base import (EngineInfo, GenerationOutput, SamplingParams, ScoredTokens, ScoreStopped, check_prompts,
                                lora_adapter_config, per_prompt_params)
from emapg.models import adapter_base_model, is_adapter_folder, read_adapter_config
from agent.engines.sampling import sample


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rows(t: torch.Tensor, chunk: int = 256) -> list[list]:
    """``t.tolist()`` of a 2-D tensor, ``chunk`` rows at a time: one ``tolist`` of millions of values holds the
    interpreter lock for a second, which the generation server's event loop (``/health``) would wait out."""
    return [row for i in range(0, len(t), chunk) for row in t[i : i + chunk].tolist()]


@contextlib.contextmanager
def _before_each_layer(model: torch.nn.Module, hook: Callable[..., None] | None) -> Iterator[None]:
    """``hook`` called before each block of the model's (first, longest) layer list -- a decoder's layers -- while
    inside; nothing when ``hook`` is None. What lets a long forward pass be stopped between layers."""
    if hook is None:
        yield
        return
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    handles = [block.register_forward_pre_hook(hook) for block in (max(stacks, key=len) if stacks else [])]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _served_lora(model) -> dict:
    """The LoRA config (``lora_adapter_config`` form) of a peft model's adapters."""
    c = model.peft_config["default"]
    return lora_adapter_config({"r": int(c.r), "lora_alpha": float(c.lora_alpha), "target_modules": sorted(c.target_modules)})


def _adapter_shapes(linear_shapes: dict[str, tuple[int, ...]], config: dict) -> dict[str, tuple[int, int]]:
    """The peft saved names and shapes of LoRA adapters of ``config`` on linear layers of these (out, in) shapes
    (peft's rule: a layer whose name is a target or ends in ``.<target>``): A (r, in), B (out, r)."""
    r, targets = config["r"], config["target_modules"]
    out: dict[str, tuple[int, int]] = {}
    for name, (o, i) in linear_shapes.items():
        if any(name == t or name.endswith("." + t) for t in targets):
            out[f"base_model.model.{name}.lora_A.weight"] = (r, i)
            out[f"base_model.model.{name}.lora_B.weight"] = (o, r)
    return out


class HFEngine:
    """Generation with a transformers causal LM. Thread-safe per call (one lock)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_model_len: int | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        max_lora_rank: int | None = None,
    ) -> None:
        """``max_lora_rank``: the largest LoRA rank :meth:`load_lora` accepts (None: any; 0: no adapters)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if is_adapter_folder(model_path):  # a LoRA run's policy: its base with the adapters (kept unmerged: load_lora swaps them)
            from peft import PeftModel

            base = adapter_base_model(model_path)
            if max_lora_rank is not None:  # it serves these adapters whatever the limit for later ones
                max_lora_rank = max(max_lora_rank, int(read_adapter_config(model_path)["r"]))
            tokenizer_from = model_path if (Path(model_path) / "tokenizer_config.json").is_file() else base
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
            self.model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=_DTYPES[dtype]), str(model_path))
            self.model = self.model.to(device).eval()
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(device).eval()
        self.device = torch.device(device)
        # (out, in) of every linear layer of the base, by name: what LoRA adapters must fit (load_lora).
        base_model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self._linear_shapes = {n.removesuffix(".base_layer"): tuple(m.weight.shape) for n, m in base_model.named_modules()
                               if isinstance(m, torch.nn.Linear) and ".lora_" not in n}
        cfg = self.model.config
        limit = getattr(cfg, "max_position_embeddings", None) or 4096
        self.max_model_len = min(max_model_len or limit, limit)
        self.max_batch_size = max_batch_size
        self.vocab_size = cfg.vocab_size
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (eos[0] if eos else 0)
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, list[int], SamplingParams]] = deque()
        self._asleep = False
        self.info = EngineInfo("hf", str(model_path), self.max_model_len, supports_sleep=self.device.type == "cuda",
                               serves_lora=max_lora_rank != 0, max_lora_rank=max_lora_rank or None)

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationOutput]:
        plist = per_prompt_params(params, len(prompt_ids))
        check_prompts(prompt_ids, self.vocab_size, self.max_model_len, [p.max_tokens for p in plist])
        if self._asleep:
            raise RuntimeError("the engine is asleep; call wake() before generate()")
        # Rows that differ only in seed / max_tokens share a batch; those two are per row.
        groups: dict[SamplingParams, list[int]] = {}
        for i, p in enumerate(plist):
            groups.setdefault(p.with_(seed=None, max_tokens=1), []).append(i)
        outputs: list[GenerationOutput | None] = [None] * len(prompt_ids)
        with self._lock, torch.inference_mode():
            for shared, idx in groups.items():
                for start in range(0, len(idx), self.max_batch_size):
                    rows = idx[start : start + self.max_batch_size]
                    seeds = [plist[i].seed if plist[i].seed is not None else self._fresh_seed() for i in rows]
                    outs = self._generate_batch(
                        [prompt_ids[i] for i in rows], shared, seeds, [plist[i].max_tokens for i in rows]
                    )
                    for i, out in zip(rows, outs):
                        outputs[i] = out
        return outputs  # type: ignore[return-value]

    def _fresh_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], max_tokens: list[int]
    ) -> list[GenerationOutput]:
        from transformers import DynamicCache

        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        cache = DynamicCache()
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        result: list[GenerationOutput | None] = [None] * n
        rows = list(range(n))  # original index of each live row
        stop_window = max((len(s) for s in params.stop), default=0) + 8
        logits = self.model(
            input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
        ).logits[:, -1, :]
        next_pos = pos[:, -1] + 1
        while True:
            tok, lp = sample(logits, params, [gens[r] for r in rows])
            tok_list, lp_list = tok.tolist(), lp.tolist()
            keep = []
            for j, r in enumerate(rows):
                tokens[r].append(tok_list[j])
                logps[r].append(lp_list[j])
                done = self._finished(tokens[r], params, stop_window)
                if done is None and len(tokens[r]) >= max_tokens[r]:
                    done = ("length", None)
                if done is None:
                    keep.append(j)
                else:
                    result[r] = GenerationOutput(tokens[r], logps[r], done[0], done[1])
            if not keep:
                break
            if len(keep) < len(rows):  # drop finished rows from the batch and the KV cache
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                attn, next_pos, tok = attn[sel], next_pos[sel], tok[sel]
                rows = [rows[j] for j in keep]
            attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=attn.dtype, device=self.device)], dim=1)
            logits = self.model(
                input_ids=tok.unsqueeze(1),
                attention_mask=attn,
                position_ids=next_pos.unsqueeze(1),
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            next_pos = next_pos + 1
        return result  # type: ignore[return-value]

    def _finished(self, toks: list[int], params: SamplingParams, window: int) -> tuple[str, str | None] | None:
        """("stop", reason) when the last token ends the sequence, else None.

        A stop string counts when it appears in the decoded generated text; since this is
        checked after every token, the first hit is at the token that completes it. Only a
        window of recent tokens is decoded (a stop string spans at most len(stop) tokens,
        plus a few that decode to nothing, such as partial UTF-8 bytes).
        """
        if toks[-1] in self.eos_ids and not params.ignore_eos:
            return ("stop", None)
        if params.stop:
            text = self.tokenizer.decode(toks[-window:], skip_special_tokens=True)
            for s in params.stop:  # vLLM reports the first stop string in list order
                if s in text:
                    return ("stop", s)
        return None

    # ------------------------------------------------- continuous-batching interface
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._queue.append((request_id, prompt_ids, params))

    def step(self) -> list[tuple[str, GenerationOutput]]:
        """Run every queued request to completion in one batched call.

        This engine has no continuous batching: a step returns only when the slowest
        queued request is done. (vLLM's step advances all requests by one token.)
        """
        pending = list(self._queue)
        self._queue.clear()
        if not pending:
            return []
        outs = self.generate([ids for _, ids, _ in pending], [p for _, _, p in pending])
        return [(rid, out) for (rid, _, _), out in zip(pending, outs)]

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    # ------------------------------------------------------------------ scoring
    def score(self, token_ids: list[list[int]], start: list[int]) -> list[list[float]]:
        """log p(token_t | tokens_<t) for t >= start[i] (raw model distribution, temperature 1)."""
        return [scored.logprobs for scored in self.score_topk(token_ids, start, topk=0)]

    def score_topk(self, token_ids: list[list[int]], start: list[int], *, topk: int,
                   temperature: float = 1.0, should_stop: Callable[[], bool] | None = None) -> list[ScoredTokens]:
        """:meth:`score` with each position's ``topk`` most likely tokens, under softmax(logits / ``temperature``).
        ``should_stop`` (the server's: its client went away) is checked before each sequence and each decoder layer;
        when it says so, :class:`agent.engines.base.ScoreStopped` is raised."""
        if len(token_ids) != len(start):
            raise ValueError("token_ids and start must have the same length")
        if not 0 <= topk <= self.vocab_size or not temperature > 0:
            raise ValueError(f"topk must be in [0, {self.vocab_size}] and temperature > 0, got {topk} and {temperature}")

        def check(*_: Any) -> None:
            if should_stop is not None and should_stop():
                raise ScoreStopped("scoring stopped: its requester went away")

        out = []
        with self._lock, torch.inference_mode(), _before_each_layer(self.model, check if should_stop else None):
            for ids, s in zip(token_ids, start):
                if not 1 <= s < len(ids) + 1:
                    raise ValueError(f"start must be in [1, len(ids)], got {s}")
                check()
                x = torch.tensor([ids], dtype=torch.long, device=self.device)
                logp = (self.model(input_ids=x).logits[0, s - 1 : len(ids) - 1].float() / temperature).log_softmax(-1)
                top = torch.topk(logp, topk, dim=-1)
                out.append(ScoredTokens(logp.gather(-1, x[0, s:, None])[:, 0].tolist(), _rows(top.indices), _rows(top.values)))
        return out

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a trainer's (HF-named) state dict into the model in place (full weights: adapters being served are dropped)."""
        if self._asleep:
            self.wake()
        with self._lock, torch.no_grad():
            if hasattr(self.model, "unload"):  # a peft model: full weights replace base + adapters
                self.model = self.model.unload()
            missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
            tied = set(getattr(self.model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
            missing = [k for k in missing if k not in tied]
            if unexpected or missing:
                raise ValueError(f"state dict does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}")

    def load_lora(self, adapters: dict[str, torch.Tensor], config: dict) -> None:
        """Serve the base with these LoRA adapters (peft saved names), unmerged: the first call wraps the model
        with peft adapters of ``config`` (:func:`agent.engines.base.lora_adapter_config`), every call copies
        the adapter tensors in. The base weights are never touched."""
        from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict

        config = lora_adapter_config(config)
        problem = self.info.lora_problem(config["r"])
        if problem:
            raise ValueError(f"cannot serve LoRA adapters: {problem}")
        if self._asleep:
            self.wake()
        # Checked before anything changes: a refused sync leaves the served adapters as they were.
        want = _adapter_shapes(self._linear_shapes, config)
        bad = sorted(set(want) ^ set(adapters)) or sorted(k for k in want if tuple(adapters[k].shape) != want[k])
        if bad:
            raise ValueError(f"LoRA adapters do not match the served model's (rank {config['r']}, "
                             f"targets {config['target_modules']}): first mismatch {bad[:3]}")
        with self._lock, torch.no_grad():
            if isinstance(self.model, PeftModel) and _served_lora(self.model) != config:  # another run's adapters: start over
                self.model = self.model.unload()
            if not isinstance(self.model, PeftModel):
                self.model = get_peft_model(self.model, LoraConfig(**config, lora_dropout=0.0, bias="none")).eval()
            set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in adapters.items()})

    def sleep(self) -> bool:
        """Offload weights to CPU on an accelerator; a no-op on CPU (returns False)."""
        if self.device.type == "cpu":
            return False
        self.model.to("cpu")
        self._asleep = True
        return True

    def wake(self) -> None:
        if self._asleep:
            self.model.to(self.device)
            self._asleep = False

    def close(self) -> None:
        self.model = None
