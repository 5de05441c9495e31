"""Supervised warm start: token-mean NLL of the model's own tokens in search-agent trajectories.

The loss of a batch of trajectories is

    L = − Σ_i Σ_t m_it · log π(y_it | context) / Σ_i Σ_t m_it

with ``m = Trajectory.loss_mask``: 1 on the model's turns, 0 on observations (retrieved passages,
corrective messages), so the policy learns to search and answer, never to predict the retriever.
Rows are padded exactly as the RL trainer pads rollouts (``trainer.batch.build_token_batch``) and
log-probs come from the same fused lm_head pass (``trainer.model_forward.causal_lm_token_stats``).

Output (``run.output_dir``): ``policy/`` -- a full HF folder (config, safetensors, tokenizer) that
transformers and vLLM load and ``emapg train`` accepts as ``model.policy`` (the folder, or the run
folder, which resolves to it); with LoRA also ``adapter/`` in peft format; ``sft_record.json``
(data counts, settings, the loss curve, ``trained_questions``: count and digest); ``trajectories.jsonl``
(what was trained on). ``policy/`` and ``adapter/`` carry ``trained_questions.json``
(:mod:`tasks.contamination`): the questions of every trajectory (the held-out-loss ones too, to be safe)
and those the initial policy's own record lists, so ``emapg eval`` of the result refuses to score them.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from agent.rollout import Trajectory
from emapg.atomic import write_folder_atomic, write_text_atomic
from emapg.config import to_dict
from tasks.contamination import TRAINED_QUESTIONS, TrainedQuestions, read_trained_questions
from trainer.batch import build_token_batch, pad_id_of
from trainer.model_forward import causal_lm_token_stats
from trainer.sft.config import SFTConfig

log = logging.getLogger(__name__)


def masked_nll(model: torch.nn.Module, trajs: Sequence[Trajectory], *, pad_id: int, chunk_size: int,
               device: torch.device) -> tuple[torch.Tensor, int]:
    """(Σ −log π over the model tokens of ``trajs``, number of model tokens); differentiable."""
    tb = build_token_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                           [t.loss_mask for t in trajs], pad_id=pad_id)
    mb = tb.micro(slice(None), device=device)
    stats = causal_lm_token_stats(model, mb.input_ids, mb.attention_mask, mb.response_width, chunk_size=chunk_size)
    return -(stats.logp * mb.loss_mask).sum(), int(mb.loss_mask.sum().item())


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, trajs: Sequence[Trajectory], *, pad_id: int, chunk_size: int,
                 device: torch.device, batch_size: int = 4) -> float:
    """Token-mean NLL of the model tokens of ``trajs`` (the held-out SFT loss)."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for i in range(0, len(trajs), batch_size):
        nll, n = masked_nll(model, trajs[i : i + batch_size], pad_id=pad_id, chunk_size=chunk_size, device=device)
        total, tokens = total + float(nll), tokens + n
    model.train(was_training)
    return total / max(tokens, 1)


@dataclass
class SFTResult:
    output_dir: Path
    heldout_loss_before: float
    heldout_loss_after: float
    train_loss: list[float] = field(default_factory=list)  # per optimizer step (token mean)
    heldout_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)
    seconds: float = 0.0


def _device(cfg: SFTConfig) -> torch.device:
    if cfg.run.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.run.device)


def fine_tune(cfg: SFTConfig, model_path: str, train: list[Trajectory], heldout: list[Trajectory], *,
              record: dict[str, Any] | None = None, trained: TrainedQuestions | None = None, progress=None) -> SFTResult:
    """Fine-tune ``model_path`` on ``train``; measure the held-out loss; write ``cfg.output_path``.

    ``trained``: the record of the trajectories' questions by source (default: all of them as one source
    ``"sft"``); the initial policy's own record, if its folder has one, is added.
    """
    trained = trained or TrainedQuestions.from_questions({"sft": [t.question for t in [*train, *heldout]]})
    trained = trained.union(read_trained_questions(model_path) if Path(model_path).is_dir() else None)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    device = _device(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.model.lora.enabled:
        from trainer.lora import apply_lora

        model = apply_lora(model, cfg.model.lora, base_model_name_or_path=cfg.model.policy)
    pad_id = pad_id_of(tokenizer)
    kw = dict(pad_id=pad_id, chunk_size=cfg.model.chunk_size, device=device)
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (o.warmup_steps + 1)))
    before = heldout_loss(model, heldout, **kw)
    result = SFTResult(cfg.output_path, before, before, heldout_curve=[(0, before)])
    log.info("held-out SFT loss before: %.4f (%d trajectories)", before, len(heldout))
    rng = random.Random(cfg.run.seed)
    steps_per_epoch = math.ceil(len(train) / o.batch_size)
    step = 0
    model.train()
    for _epoch in range(o.epochs):
        order = list(range(len(train)))
        rng.shuffle(order)
        for b in range(steps_per_epoch):
            batch = [train[i] for i in order[b * o.batch_size : (b + 1) * o.batch_size]]
            nll, n = masked_nll(model, batch, **kw)
            if n == 0:
                continue
            loss = nll / n
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if o.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            result.train_loss.append(float(loss.detach()))
            if o.eval_every and step % o.eval_every == 0:
                result.heldout_curve.append((step, heldout_loss(model, heldout, **kw)))
            if progress is not None:
                progress(step, steps_per_epoch * o.epochs, float(loss))
    result.heldout_loss_after = heldout_loss(model, heldout, **kw)
    if result.heldout_curve[-1][0] != step:
        result.heldout_curve.append((step, result.heldout_loss_after))
    result.seconds = time.perf_counter() - start
    log.info("held-out SFT loss after: %.4f", result.heldout_loss_after)
    save_policy(model, tokenizer, cfg, result, record or {}, trained)
    return result


def save_policy(model: torch.nn.Module, tokenizer, cfg: SFTConfig, result: SFTResult, record: dict[str, Any],
                trained: TrainedQuestions) -> None:
    """Write ``policy/`` (full HF folder; with LoRA also ``adapter/``), each with ``trained_questions.json``,
    and ``sft_record.json`` atomically."""
    out = cfg.output_path
    out.mkdir(parents=True, exist_ok=True)
    record_text = trained.to_json()
    if cfg.model.lora.enabled:
        from trainer.lora import save_adapter

        write_folder_atomic(out / "adapter", lambda tmp: (save_adapter(tmp, model),
                                                          (tmp / TRAINED_QUESTIONS).write_text(record_text)))
        model = model.merge_and_unload()
    write_folder_atomic(out / "policy", lambda tmp: (model.save_pretrained(tmp, safe_serialization=True),
                                                     tokenizer.save_pretrained(tmp),
                                                     (tmp / TRAINED_QUESTIONS).write_text(record_text)))
    full = {
        **record,
        "trained_questions": trained.summary(),
        "config": to_dict(cfg),
        "heldout_loss_before": result.heldout_loss_before,
        "heldout_loss_after": result.heldout_loss_after,
        "heldout_curve": result.heldout_curve,
        "train_loss": result.train_loss,
        "seconds": round(result.seconds, 1),
    }
    write_text_atomic(out / "sft_record.json", json.dumps(full, indent=2) + "\n")


def replay_context_len(rollout, model_path: str) -> int:
    """The engine window the trainer would give this rollout config (``Trainer``: prompt + response caps,
    at most the model's own limit), so replayed trajectories hit the same context stops."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 4096
    return min(rollout.max_prompt_tokens + rollout.max_response_tokens, limit)


def run_sft(cfg: SFTConfig, *, progress=None) -> SFTResult:
    """``emapg sft``: build the trajectories (constructed or from a file), split off the held-out part,
    fine-tune, save. Returns the result; ``sft_record.json`` has the counts."""
    import contextlib

    from transformers import AutoTokenizer

    from emapg.models import resolve_model
    from tasks.heldout import heldout_questions
    from trainer.sft.data import (
        construct_trajectories,
        file_trajectories,
        split_heldout,
        trained_questions,
        trajectory_record,
        training_examples,
    )

    model_path = resolve_model(cfg.model.policy, option="model.policy")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    context = replay_context_len(cfg.rollout, model_path)
    d = cfg.data
    with contextlib.ExitStack() as stack:
        retriever = None
        if cfg.retriever.urls or cfg.retriever.index_dir:
            from provision.retrievers import open_retriever

            r = cfg.retriever
            retriever = stack.enter_context(open_retriever(
                urls=r.urls, index_dir=r.index_dir, topk=cfg.rollout.topk, timeout=r.timeout, retries=r.retries,
                api_key_env=r.api_key_env))
        exclude = heldout_questions() if (d.source == "construct" or d.exclude_eval_questions) else None
        if d.source == "construct":
            examples = training_examples(d.datasets, limit=d.limit, seed=cfg.run.seed)
            pairs, report = construct_trajectories(examples, tokenizer, retriever, cfg.rollout, max_model_len=context,
                                                   exclude=exclude)
            counts = report.to_dict()
            log.info("constructed trajectories: kept %d of %d built (%s)", report.total_kept, report.total_constructed,
                     counts["kept"])
        else:
            trajs, counts = file_trajectories(d.path, tokenizer, retriever, cfg.rollout, max_model_len=context,
                                              exclude=exclude)
            pairs = [(t, None) for t in trajs]
    if d.max_trajectories is not None and len(pairs) > d.max_trajectories:
        picked = sorted(random.Random(cfg.run.seed).sample(range(len(pairs)), d.max_trajectories))
        pairs = [pairs[i] for i in picked]  # a seeded sample over every dataset, not the first file rows
    train_pairs, held_pairs = split_heldout(pairs, d.heldout_fraction, cfg.run.seed)
    out = cfg.output_path
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "trajectories.jsonl", "".join(
        json.dumps({**trajectory_record(t, ex), "heldout": held}) + "\n"
        for held, part in ((False, train_pairs), (True, held_pairs)) for t, ex in part))
    record = {"model": cfg.model.policy, "model_path": model_path, "data": counts,
              "trajectories": {"train": len(train_pairs), "heldout": len(held_pairs),
                               "model_tokens": sum(t.num_model_tokens for t, _ in pairs),
                               "tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t, _ in pairs)}}
    trained = trained_questions(train_pairs, held_pairs, file_source=Path(d.path).name if d.path else "file")
    return fine_tune(cfg, model_path, [t for t, _ in train_pairs], [t for t, _ in held_pairs], record=record,
                     trained=trained, progress=progress)
