"""On-policy distillation: the student samples, a teacher scores every sampled token, the student
minimises the per-token reverse KL(πθ‖π_T) on its own samples (``algorithm.distill``).

The teacher's scores of a response (:class:`TeacherScores`, all detached): ``logp`` ``(B, T)`` — log π_T
of the sampled token; ``topk_logp``/``topk_indices`` ``(B, T, k)`` — the teacher's own top-k tokens
and their (normalised, not renormalised over the k) log-probabilities at each position, at the
same temperature as the student's statistics.

Estimators (registered by name, :func:`get_distill_estimator`), each a per-token loss ``(B, T)``:

* ``sampled_reverse_kl`` — the on-policy distillation literature's per-token advantage
  A_t = −(log πθ(y_t) − log π_T(y_t)) on the sampled token, as the REINFORCE term
  ``−sg(A_t) · s_t`` with s = πθ/π_old (= 1 in value on-policy)::

      value  sg(log πθ − log π_T)          (an unbiased sample of KL(πθ‖π_T) at this prefix)
      ∇      (log πθ − log π_T) ∇log πθ   (in expectation over πθ's samples: ∇KL(πθ‖π_T))

  no clip: it is the distillation term, separate from the task's PPO term.
* ``topk_reverse_kl`` — the Top-k reverse KL of :func:`trainer.algo.topk_kl.topk_reverse_kl` with q =
  the teacher's top-k and the reference = the teacher: the exact head Σ_{j∈q} πθ(j)(log πθ(j) − log π_T(j))
  plus the sampled tail on tokens outside q, with the unbiased gradient (``tail_grad="exact"``), so its
  value and gradient are KL(πθ‖π_T) and ∇KL in expectation over πθ's samples for any k.
* ``topk_forward_kl`` — the forward KL(π_T‖πθ) of the two distributions coarsened to k + 1 outcomes: the
  teacher's top-k tokens q and one bucket for the rest (:func:`teacher_topk_forward_kl`)::

      Σ_{j∈q} π_T(j)(log π_T(j) − log πθ(j)) + t_T (log t_T − log t_θ),   t = 1 − Σ_{j∈q} π(j)

  exact at every prefix (no sampled term; the sampled token does not enter), a lower bound of the full
  forward KL (data processing), equal to it when k covers the vocabulary. Its gradient in the student's
  logits is πθ − π_T on q (with the bucket for the rest), which stays O(1) where the student has put all
  its mass on a token the teacher rules out -- exactly where the reverse KL's gradient, πθ(j)(log πθ(j) −
  log π_T(j) − KL), vanishes with the probability of the teacher's choice (measured: a student that
  answers at once where the teacher searches, ``docs/training.md``). The prefixes are the student's own
  samples (GKD's on-policy data with its forward-KL divergence, arXiv 2306.13649).

Off-policy (the engine μ sampled the tokens, not π_old: ``rollout.max_staleness`` ≥ 1, top-p, other kernels) the
sampled terms need the behaviour correction's weight w: the caller passes ``old_logp`` = log π_old − log w
(:func:`trainer.algo.behavior.kl_old_logp`, as for the KL term), so s becomes (πθ/π_old)·w; with w = ρ = π_old/μ the
expected value and gradient over μ's samples are the on-policy ones (``tests/trainer/test_distill.py``, by
enumeration). ``topk_forward_kl`` has no sampled term and ignores ``old_logp``.

Modes (:data:`DistillMode`): ``alone`` — the loss is the distillation term (the task reward's
policy-gradient term is dropped); ``added`` — the task's policy loss + coef · distillation;
``below_best`` — added, but only on trajectories whose reward is below their group's best
(DGPO-style: the best answers are left to the task reward; :func:`below_best_rows`).

Tokens outside the loss mask (observations, tool output, padding) are never distilled: their values
are replaced by 0 before aggregation and receive no gradient (``tests/trainer/test_distill.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal, Mapping, Sequence

import torch
from torch import Tensor

from trainer.algo.grpo import LossAggregation, aggregate_loss, group_index
from trainer.algo.kl import LOG_RATIO_CLAMP
from trainer.algo.token_stats import TokenStats
from trainer.algo.topk_kl import topk_reverse_kl

__all__ = [
    "DISTILL_ESTIMATORS",
    "DISTILL_MODES",
    "DistillEstimator",
    "DistillMode",
    "TeacherScores",
    "below_best_rows",
    "distill_estimator_names",
    "distill_loss",
    "distill_metrics",
    "get_distill_estimator",
    "register_distill_estimator",
    "sampled_reverse_kl_advantage",
    "teacher_topk_forward_kl",
    "teacher_from_stored",
]

DistillMode = Literal["alone", "added", "below_best"]
DISTILL_MODES: tuple[str, ...] = ("alone", "added", "below_best")


@dataclass(frozen=True)
class TeacherScores:
    """The teacher's scores of sampled responses (see the module docstring); constants."""

    logp: Tensor  # (B, T)
    topk_logp: Tensor | None = None  # (B, T, k)
    topk_indices: Tensor | None = None  # (B, T, k)


def teacher_from_stored(stored: Mapping[str, Tensor]) -> TeacherScores | None:
    """The teacher's scores among the stored statistics (``teacher_logp``, ``teacher_topk_logp``,
    ``teacher_topk_indices``), or ``None`` when the batch was not scored."""
    if "teacher_logp" not in stored:
        return None
    return TeacherScores(stored["teacher_logp"], stored.get("teacher_topk_logp"), stored.get("teacher_topk_indices"))


def _ratio(logp: Tensor, old_logp: Tensor | None) -> Tensor:
    """s = πθ/π_old of the sampled token (value 1 and gradient ∇log πθ on-policy)."""
    old = logp.detach() if old_logp is None else old_logp.detach()
    return torch.exp(torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def teacher_topk_forward_kl(student_logp_k: Tensor, teacher_logp_k: Tensor, *, tail_floor: float = 1e-12) -> Tensor:
    """Per-token forward KL(π_T‖πθ) over the teacher's top-k plus one bucket for every other token ``(B, T)``.

    ``student_logp_k``: ``(B, T, k)`` log πθ at the teacher's top-k tokens (normalised over the whole
    vocabulary, differentiable); ``teacher_logp_k``: ``(B, T, k)`` log π_T there (constants; -inf allowed).
    The rest bucket's masses are 1 − Σ_q π; the student's is floored at ``tail_floor`` (the only place a
    value or gradient is clipped: a student with no mass left outside q, to float precision)."""
    teacher_logp_k = teacher_logp_k.detach()
    p_teacher = teacher_logp_k.exp()
    head = (torch.special.xlogy(p_teacher, p_teacher) - torch.where(p_teacher > 0, p_teacher * student_logp_k,
                                                                      torch.zeros_like(student_logp_k))).sum(-1)
    t_teacher = torch.clamp(1.0 - p_teacher.sum(-1), min=0.0)
    t_student = torch.clamp(-torch.expm1(torch.logsumexp(student_logp_k, -1)), min=tail_floor)
    return head + torch.special.xlogy(t_teacher, t_teacher) - t_teacher * torch.log(t_student)


def sampled_reverse_kl_advantage(logp: Tensor, teacher_logp: Tensor, loss_mask: Tensor) -> Tensor:
    """The per-token distillation advantage A = −(log πθ − log π_T) of the sampled tokens ``(B, T)``,
    detached, 0 outside ``loss_mask``."""
    a = -(logp.detach() - teacher_logp.detach())
    return torch.where(loss_mask.bool(), a, torch.zeros_like(a))


class DistillEstimator:
    """A per-token distillation loss; ``needs_topk``: the student's logits are gathered on the teacher's top-k."""

    name: str = ""
    needs_topk: bool = False

    def per_token(self, policy: TokenStats, teacher: TeacherScores, labels: Tensor, loss_mask: Tensor, *,
                  old_logp: Tensor | None = None) -> Tensor:
        raise NotImplementedError


def _require_topk(name: str, policy: TokenStats, teacher: TeacherScores) -> None:
    if teacher.topk_logp is None or teacher.topk_indices is None or policy.topk_logits is None:
        raise ValueError(f"{name} distillation needs the teacher's top-k and the student's logits gathered there")


class SampledReverseKL(DistillEstimator):
    name = "sampled_reverse_kl"

    def per_token(self, policy, teacher, labels, loss_mask, *, old_logp=None):
        return -sampled_reverse_kl_advantage(policy.logp, teacher.logp, loss_mask) * _ratio(policy.logp, old_logp)


class TopkReverseKLDistill(DistillEstimator):
    name = "topk_reverse_kl"
    needs_topk = True

    def per_token(self, policy, teacher, labels, loss_mask, *, old_logp=None):
        _require_topk(self.name, policy, teacher)
        zeros = torch.zeros_like(teacher.logp)
        return topk_reverse_kl(
            logits_k=policy.topk_logits, logsumexp=policy.logsumexp, logp=policy.logp,
            ref_logits_k=teacher.topk_logp, ref_logsumexp=zeros, ref_logp=teacher.logp,
            topk_indices=teacher.topk_indices, labels=labels, old_logp=old_logp, tail_grad="exact",
        )


class TopkForwardKLDistill(DistillEstimator):
    name = "topk_forward_kl"
    needs_topk = True

    def per_token(self, policy, teacher, labels, loss_mask, *, old_logp=None):
        _require_topk(self.name, policy, teacher)
        return teacher_topk_forward_kl(policy.topk_logits - policy.logsumexp[..., None], teacher.topk_logp)


DISTILL_ESTIMATORS: dict[str, DistillEstimator] = {}


def register_distill_estimator(est: DistillEstimator) -> DistillEstimator:
    """Add ``est`` under its name (a later registration of the same name replaces it)."""
    if not est.name:
        raise ValueError("a distillation estimator needs a name")
    DISTILL_ESTIMATORS[est.name] = est
    return est


register_distill_estimator(SampledReverseKL())
register_distill_estimator(TopkReverseKLDistill())
register_distill_estimator(TopkForwardKLDistill())


def distill_estimator_names() -> list[str]:
    return sorted(DISTILL_ESTIMATORS)


def get_distill_estimator(name: str) -> DistillEstimator:
    try:
        return DISTILL_ESTIMATORS[name]
    except KeyError:
        raise KeyError(f"unknown distillation estimator {name!r}; known: {', '.join(distill_estimator_names())}") from None


def below_best_rows(rewards: Sequence[float] | Tensor, group_ids: Sequence[Hashable] | Tensor) -> Tensor:
    """``(N,)`` bool: the trajectory's reward is strictly below the best of its group (DGPO's rows to
    distil; a group of equal rewards has none)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    idx = group_index(group_ids)
    best = torch.full((int(idx.max()) + 1 if idx.numel() else 0,), -float("inf"), dtype=torch.float64)
    best = best.scatter_reduce(0, idx, r, reduce="amax")
    return r < best[idx]


def _only_on(teacher: TeacherScores, mask: Tensor) -> TeacherScores:
    """The teacher's scores with every position outside ``mask`` replaced by 0 (a masked token's scores,
    whatever they are — never computed, NaN — can then reach neither the value nor the gradient)."""
    def clean(x: Tensor | None) -> Tensor | None:
        if x is None:
            return None
        m = mask.reshape(mask.shape + (1,) * (x.dim() - mask.dim()))
        return torch.where(m, x.detach(), torch.zeros_like(x))

    return TeacherScores(clean(teacher.logp), clean(teacher.topk_logp), teacher.topk_indices)


def distill_loss(
    name: str,
    policy: TokenStats,
    teacher: TeacherScores,
    labels: Tensor,
    loss_mask: Tensor,
    agg: LossAggregation,
    *,
    old_logp: Tensor | None = None,
    row_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation loss of one micro-batch (normalised like the policy loss by ``agg``) and its metric sums.

    ``policy``: the student's differentiable statistics (gathered on ``teacher.topk_indices`` for a
    top-k estimator); ``labels``, ``loss_mask``: ``(B, T)``; ``old_logp``: log π_old of the sampled tokens, minus
    log w of the behaviour correction when the engine sampled them (``None``: on-policy); ``row_weights``: ``(B, T)``
    or ``(B, 1)`` multipliers (``below_best``: 1 on the rows to distil, 0 elsewhere; the rows left out still count in
    ``agg``'s normaliser, so a distilled token weighs as in ``added``). Metrics (detached sums): ``distill/tokens`` distilled tokens,
    ``distill/rkl_sum`` Σ(log πθ − log π_T) on them (the sampled reverse-KL estimate),
    ``distill/value_sum`` Σ of the estimator's per-token values, ``distill/loss`` the aggregated loss.
    """
    m = loss_mask.bool()
    teacher = _only_on(teacher, m)
    per_token = get_distill_estimator(name).per_token(policy, teacher, labels, loss_mask, old_logp=old_logp)
    w = m.to(per_token.dtype)
    if row_weights is not None:
        w = w * row_weights.to(per_token.dtype).expand_as(w)
    keep = w > 0
    values = torch.where(keep, per_token, torch.zeros_like(per_token)) * w
    loss = aggregate_loss(values, loss_mask, agg)
    rkl = torch.where(keep, (policy.logp.detach() - teacher.logp.detach()).float(), torch.zeros_like(w, dtype=torch.float32))
    metrics = {
        "distill/tokens": keep.sum().to(torch.float32),
        "distill/rkl_sum": rkl.sum(),
        "distill/value_sum": values.detach().float().sum(),
        "distill/loss": loss.detach(),
    }
    return loss, metrics


def distill_metrics(s: Mapping[str, float], *, world_size: int = 1, steps: int = 1) -> dict[str, float]:
    """The logged ``distill/*`` metrics from the rank-summed sums (empty without them): the mean reverse-KL
    estimate per distilled token, the share of loss tokens distilled, the mean aggregated loss per optimizer step."""
    if "distill/tokens" not in s:
        return {}
    n = max(s["distill/tokens"], 1.0)
    out = {
        "distill/reverse_kl": s["distill/rkl_sum"] / n,
        "distill/value_mean": s["distill/value_sum"] / n,
        "distill/loss": s["distill/loss"] / max(world_size, 1) / max(steps, 1),
        "distill/tokens": s["distill/tokens"],
    }
    if "update/tokens" in s:
        out["distill/token_frac"] = s["distill/tokens"] / max(s["update/tokens"], 1.0)
    return out
