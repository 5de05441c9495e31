"""The distillation teacher (``algorithm.distill``): scores every sampled response token.

For each response position of a :class:`~trainer.batch.TokenBatch` the teacher gives log π_T of the sampled
token and, for a top-k estimator, its own top-k tokens and their log-probabilities, under
softmax(logits / ``rollout.temperature``) like the policy's statistics (:mod:`trainer.algo.distill`).
:class:`Distillation` (the step's concern: the teacher and its pass over each batch, :mod:`trainer.passes`) puts them
in ``batch.stored`` beside the anchor's:

========================= ========== ===========================================================
``teacher_logp``          (N, T)     log π_T of the sampled token (0 past a row's response)
``teacher_topk_logp``     (N, T, k)  the teacher's top-k log-probabilities (top-k estimators)
``teacher_topk_indices``  (N, T, k)  their token ids
``distill_rows``          (N, T)     ``mode=below_best``: 1 on rows below their group's best reward
========================= ========== ===========================================================

Two teachers:

* :class:`LocalTeacher` — a second model on the trainer's device (``distill.teacher``: a path or alias), its
  scores from the chunked token-statistics pass (:func:`trainer.algo.token_stats.token_stats_from_hidden`,
  no ``(T, V)`` logits held).
* :class:`RemoteTeacher` — ``emapg engine serve --model TEACHER`` servers (``distill.teacher_urls``), through
  their ``POST /score`` route with ``topk``/``temperature`` (transformers: exact; vLLM: its prompt log-probs,
  temperature 1 only).

Both refuse a teacher whose tokenizer differs from the policy's (:func:`check_same_tokenizer`): the scores
of another vocabulary's ids would be meaningless.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from emapg.config import ConfigError
from trainer.batch import TokenBatch
from trainer.passes import run_passes

__all__ = ["LocalTeacher", "RemoteTeacher", "TeacherScores", "Distillation", "build_teacher", "check_same_tokenizer",
           "distill_gathers_topk"]


def check_same_tokenizer(teacher: dict, policy: dict) -> None:
    """Raise :class:`ConfigError` naming both tokenizers unless ``teacher`` and ``policy``
    (:func:`agent.engines.base.tokenizer_fingerprint` dicts) map every token to the same id."""
    if teacher.get("fingerprint") != policy.get("fingerprint"):
        raise ConfigError(
            f"the distillation teacher's tokenizer {teacher.get('name')!r} ({teacher.get('size')} tokens, fingerprint "
            f"{teacher.get('fingerprint')}) differs from the policy's tokenizer {policy.get('name')!r} ({policy.get('size')} "
            f"tokens, fingerprint {policy.get('fingerprint')}); on-policy distillation needs a teacher with the same tokenizer")


class LocalTeacher:
    """A teacher model in this process, on ``device`` (frozen, eval mode)."""

    def __init__(self, model: str, device: torch.device | str, *, dtype: torch.dtype = torch.float32,
                 policy_tokenizer: Any = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from agent.engines.base import tokenizer_fingerprint
        from emapg.models import resolve_model

        path = resolve_model(model)
        self.name = str(model)
        self.tokenizer_info = tokenizer_fingerprint(AutoTokenizer.from_pretrained(path))
        if policy_tokenizer is not None:
            check_same_tokenizer(self.tokenizer_info, tokenizer_fingerprint(policy_tokenizer))
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def score_micro(self, mb: Any, *, topk: int, temperature: float, chunk_size: int) -> tuple[torch.Tensor, ...]:
        """``(logp (B, T), topk_logp (B, T, k) | None, topk_indices (B, T, k) | None)`` of one micro-batch."""
        from trainer.algo.token_stats import token_stats_from_hidden
        from trainer.model_forward import causal_lm_hidden

        hidden, head = causal_lm_hidden(self.model, mb.input_ids, mb.attention_mask, mb.response_width)
        st = token_stats_from_hidden(hidden, head.weight, mb.labels, bias=head.bias, topk=topk, temperature=temperature,
                                     chunk_size=chunk_size)
        if not topk:
            return st.logp, None, None
        return st.logp, st.topk_logits - st.logsumexp[..., None], st.topk_indices

    def score(self, batch: TokenBatch, *, topk: int, temperature: float, chunk_size: int, alg: Any,
              share_prompts: bool = False) -> dict[str, torch.Tensor]:
        """The table's ``teacher_*`` tensors of ``batch``, micro-batched by ``alg`` (:func:`trainer.batch.micro_batches`)."""
        scores = TeacherScores(self, batch, topk=topk, temperature=temperature, chunk_size=chunk_size)
        run_passes(batch, [scores], alg, self.device, share_prompts=share_prompts)
        return scores.out


class RemoteTeacher:
    """Teachers behind ``emapg engine serve`` (replicas: requests go round-robin)."""

    def __init__(self, urls: Sequence[str], *, policy_model: str, policy_tokenizer: Any = None, api_key: str | None = None,
                 timeout: float = 120.0, wait_s: float = 60.0, rows_per_request: int = 64) -> None:
        from agent.engines.base import tokenizer_fingerprint
        from agent.engines.remote import RemoteEngine

        # The policy's tokenizer is the one loaded here: the teacher's must be the same (checked below).
        self.engine = RemoteEngine(list(urls), model_path=policy_model, api_key=api_key, timeout=timeout, wait_s=wait_s)
        self.name = ", ".join(self.engine.urls)
        self.rows_per_request = rows_per_request
        try:
            for url, h in zip(self.engine.urls, self.engine.healths):
                if "tokenizer" not in h:
                    raise ConfigError(f"the teacher server {url} does not report its tokenizer in /health; update it")
                check_same_tokenizer({**h["tokenizer"], "name": f"{h['tokenizer'].get('name')} (served by {url})"},
                                     tokenizer_fingerprint(policy_tokenizer if policy_tokenizer is not None else self.engine.tokenizer))
        except BaseException:
            self.engine.close()
            raise

    def score(self, batch: TokenBatch, *, topk: int, temperature: float, chunk_size: int = 0, alg: Any = None,
              share_prompts: bool = False) -> dict[str, torch.Tensor]:
        n, t = batch.size, batch.response_width
        out = _empty(n, t, topk)
        seqs, starts, lens = [], [], []
        for i in range(n):
            p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
            ids = batch.input_ids[i, batch.prompt_width - p: batch.prompt_width + r].tolist()
            seqs.append(ids)
            starts.append(p)
            lens.append(r)
        todo = [i for i in range(n) if lens[i] > 0 and starts[i] > 0]
        for c in range(0, len(todo), self.rows_per_request):
            rows = todo[c: c + self.rows_per_request]
            scored = self.engine.score_topk([seqs[i] for i in rows], [starts[i] for i in rows], topk=topk, temperature=temperature)
            for i, s in zip(rows, scored):
                r = lens[i]
                out["teacher_logp"][i, :r] = torch.tensor(s.logprobs, dtype=torch.float32)
                if topk:
                    out["teacher_topk_logp"][i, :r] = torch.tensor(s.topk_logprobs, dtype=torch.float32)
                    out["teacher_topk_indices"][i, :r] = torch.tensor(s.topk_ids, dtype=torch.long)
        return out

    def close(self) -> None:
        self.engine.close()


def _empty(n: int, t: int, topk: int) -> dict[str, torch.Tensor]:
    out = {"teacher_logp": torch.zeros(n, t)}
    if topk:
        out["teacher_topk_logp"] = torch.zeros(n, t, topk)
        out["teacher_topk_indices"] = torch.zeros(n, t, topk, dtype=torch.long)
    return out


def build_teacher(cfg: Any, device: torch.device, *, policy_model: str, policy_tokenizer: Any) -> LocalTeacher | RemoteTeacher:
    """The teacher ``cfg.algorithm.distill`` names (:class:`trainer.config.TrainConfig`), checked against the policy's tokenizer."""
    d = cfg.algorithm.distill
    if d.teacher_urls:
        key = os.environ.get(d.teacher_api_key_env) if d.teacher_api_key_env else None
        return RemoteTeacher(d.teacher_urls, policy_model=policy_model, policy_tokenizer=policy_tokenizer, api_key=key,
                             timeout=d.timeout)
    return LocalTeacher(d.teacher, device, policy_tokenizer=policy_tokenizer)


class TeacherScores:
    """The teacher's pass over a batch (:mod:`trainer.passes`): a :class:`LocalTeacher` scores each micro-batch, a
    :class:`RemoteTeacher` the whole batch in its own requests; :meth:`finish` leaves the ``teacher_*`` tensors in
    :attr:`out` (0 past a row's response)."""

    timing = "time/teacher"

    def __init__(self, teacher: LocalTeacher | RemoteTeacher, batch: TokenBatch, *, topk: int, temperature: float,
                 chunk_size: int) -> None:
        self.teacher, self.batch, self.topk, self.temperature, self.chunk_size = teacher, batch, topk, temperature, chunk_size
        self.per_micro_batch = isinstance(teacher, LocalTeacher)
        self.out = _empty(batch.size, batch.response_width, topk)

    def micro(self, mb: Any, rows: Any) -> None:
        if mb.input_ids.device != self.teacher.device:
            mb = self.batch.micro(rows, self.teacher.device)
        lp, tk_lp, tk_idx = self.teacher.score_micro(mb, topk=self.topk, temperature=self.temperature, chunk_size=self.chunk_size)
        w = mb.response_width
        self.out["teacher_logp"][rows, :w] = lp.float().cpu()
        if self.topk:
            self.out["teacher_topk_logp"][rows, :w] = tk_lp.float().cpu()
            self.out["teacher_topk_indices"][rows, :w] = tk_idx.cpu()

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        if not self.per_micro_batch:
            self.out = self.teacher.score(batch, topk=self.topk, temperature=self.temperature)
        past = torch.arange(batch.response_width)[None, :] >= batch.response_lens[:, None]  # padding: predictions of nothing
        for v in self.out.values():
            v[past] = 0
        return {}


class Distillation:
    """``algorithm.distill`` in the training step: the teacher (:func:`build_teacher`), released by :meth:`close`, and
    its pass over each batch, which stores the table's tensors in ``batch.stored`` beside the anchor's."""

    def __init__(self, cfg: Any, device: torch.device, *, policy_model: str, policy_tokenizer: Any) -> None:
        self.cfg = cfg
        self.teacher = build_teacher(cfg, device, policy_model=policy_model, policy_tokenizer=policy_tokenizer)

    def passes(self, batch: TokenBatch, sampled: Any, rows: Any) -> list["StoredTeacherScores"]:
        """The teacher's pass over ``batch``: the :class:`~trainer.sampled_batch.TrainingRows` ``rows`` of ``sampled``
        (their rewards and groups for ``mode=below_best``; a filler row is a group of its own)."""
        group_ids = [sampled.group_ids[e] if e >= 0 else "filler" for e in rows.episode]
        return [StoredTeacherScores(self.teacher, batch, self.cfg, rewards=rows.per_row(sampled.rewards), group_ids=group_ids)]

    def close(self) -> None:
        if hasattr(self.teacher, "close"):
            self.teacher.close()


class StoredTeacherScores(TeacherScores):
    """:class:`TeacherScores` stored in ``batch.stored`` at ``algorithm.distill``'s settings, with ``distill_rows``
    for ``mode=below_best``."""

    def __init__(self, teacher: LocalTeacher | RemoteTeacher, batch: TokenBatch, cfg: Any, *, rewards: Sequence[float],
                 group_ids: Sequence[Any]) -> None:
        from trainer.algo.distill import get_distill_estimator

        d = cfg.algorithm.distill
        super().__init__(teacher, batch, topk=d.topk if get_distill_estimator(d.estimator).needs_topk else 0,
                         temperature=cfg.rollout.temperature, chunk_size=cfg.model.chunk_size)
        self.mode, self.rewards, self.group_ids = d.mode, rewards, group_ids

    def finish(self, batch: TokenBatch) -> dict[str, float]:
        from trainer.algo.distill import below_best_rows

        super().finish(batch)
        batch.stored.update(self.out)
        if self.mode == "below_best":
            rows = below_best_rows(self.rewards, self.group_ids).to(torch.float32)
            batch.stored["distill_rows"] = rows[:, None].expand(batch.size, batch.response_width).contiguous()
        return {}


def distill_gathers_topk(cfg: Any) -> bool:
    """The training pass gathers the student's logits on the teacher's top-k (a top-k ``algorithm.distill`` estimator):
    the on-policy Top-k reverse KL shortcut, which takes the policy's own top-k there, is then off."""
    from trainer.algo.distill import get_distill_estimator

    d = cfg.algorithm.distill
    return bool(d.enabled and get_distill_estimator(d.estimator).needs_topk)
