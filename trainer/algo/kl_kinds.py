"""KL kinds: every ``algorithm.kl.type`` is one registered object, a :class:`KLKind`.

A kind is everything the trainer knows about one KL term of the loss:

* its config checks (:meth:`KLKind.validate`, called by ``KLConfig.validate``);
* what it needs stored before the PPO updates (:meth:`KLKind.needs` → :class:`KLNeeds`):
  π_old's top-k indices, the anchor's logits at the top-k set and its logsumexp, the anchor's
  log-prob of the sampled token, or the anchor's final hidden states;
* its per-token loss (:meth:`KLKind.per_token`) and the aggregated loss with its metrics
  (:meth:`KLKind.loss`), from the policy's fresh statistics and the anchor's stored ones.

Config validation (:mod:`trainer.config`), stored-statistics planning
(:mod:`trainer.stored_stats`) and the loss (:mod:`trainer.step`) all read the kind; nothing
else branches on the kind's name.

What each kind is worth in expectation over the sampled token p (πθ = the policy, πref = the
anchor, q = the Top-k set, s = πθ(p)/π_old(p) when ``importance_weight`` and the tokens were
sampled from π_old), each row checked by exact enumeration in ``tests/trainer/test_kl_kinds.py``:

=============================== ============================== ============= ==========================
kind                            stored before the update       E[value]      E[gradient]
=============================== ============================== ============= ==========================
``topk_reverse``, paper tail    q = top-k of π_old; anchor     KL(πθ‖πref)   ∇KL(πθ‖πref) + ∇πθ(q)
                                logits on q, Z, log πref(p)
``topk_reverse``, exact tail    the same                       KL(πθ‖πref)   ∇KL(πθ‖πref)
``topk_forward``, paper tail    q = the anchor's top-k, its    KL(πref‖πθ)   ∇KL(πref‖πθ) − ∇πθ(q)
                                logits on q, Z, log πref(p)
``topk_forward``, exact tail    the same                       KL(πref‖πθ)   ∇KL(πref‖πθ)
``topk_reverse`` at k = 0       log πref(p)                    K4 × s, per token exactly
``topk_forward`` at k = 0       log πref(p)                    K5 × s, per token exactly
``exact_reverse``               the anchor's hidden states     KL(πθ‖πref) at every token, ∇ likewise
``exact_forward``               the anchor's hidden states     KL(πref‖πθ) at every token, ∇ likewise
a sampled estimator (``k3``...) log πref(p)                    as in the table of :mod:`trainer.algo.kl` (× s)
=============================== ============================== ============= ==========================

The exact kinds never materialise a (T, V) tensor: the anchor's final hidden states (H floats
per token) are stored, and the policy pass recomputes both models' logits per chunk
(:func:`trainer.algo.topk_kl.exact_kl_from_hidden`; our addition, the paper's exact KL stores the
anchor's V logits per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from emapg.config import ConfigError
from trainer.algo.grpo import LossAggregation, masked_mean
from trainer.algo.kl import KLEstimator, get_kl_estimator, importance_weight, kl_estimator_names, sampled_kl
from trainer.algo.token_stats import TokenStats
from trainer.algo.topk_kl import Direction, not_in_topk_mask, topk_kl

__all__ = ["KLSettings", "KLNeeds", "KLKind", "SampledKL", "TopkKL", "ExactKL", "get_kl_kind", "kl_kind_names", "register_kl_kind"]


class KLSettings(Protocol):
    """The ``algorithm.kl`` settings a kind reads (:class:`trainer.config.KLConfig` is one; the math does not
    import the config)."""

    enabled: bool
    topk: int
    tail_sampling: bool
    importance_weight: bool
    iw_clip: list[float] | None
    tail_grad: Literal["paper", "exact"]


@dataclass(frozen=True)
class KLNeeds:
    """What a KL kind needs computed before the PPO updates (read by :func:`trainer.stored_stats.plan_stored_stats`).

    ``topk``/``topk_of``: the size of the Top-k set q and whose top-k it is (``"old"``: π_old's,
    taken in the π_old pass; ``"anchor"``: the anchor's own). ``anchor_tokens``: the anchor's
    log-prob of the sampled token and logsumexp (and its logits on q when ``topk``).
    ``exact``: the anchor's final hidden states, for the exact KL in that direction.
    """

    topk: int = 0
    topk_of: Literal["old", "anchor"] | None = None
    anchor_tokens: bool = False
    exact: Direction | None = None


#: What a kind's value or gradient equals in expectation: :mod:`trainer.algo.kl`'s targets, plus the
#: Top-k gradients of the paper's release, ∇KL ± ∇πθ(q) (:mod:`trainer.algo.topk_kl`).
Expectation = Literal["reverse", "forward", "zero", "none", "reverse+grad_mass_q", "forward-grad_mass_q"]


class KLKind:
    """Base class: validation, stored-statistics needs and the loss of one KL kind.

    ``uses_importance_weight``: whether ``kl.importance_weight`` weights (part of) the estimate by
    s = πθ/π_old (the sampled estimators and the Top-k tail; not the exact KL, which samples nothing).
    """

    name: str
    uses_importance_weight: bool = True

    def expected(self, cfg: KLSettings) -> tuple[Expectation, Expectation]:
        """(E[value], E[gradient]) over p ~ the sampling policy, with these settings (the module's table)."""
        raise NotImplementedError

    def validate(self, cfg: KLSettings) -> None:
        """Raise :class:`ConfigError` (naming the ``algorithm.kl`` key) for settings this kind cannot train with."""

    def needs(self, cfg: KLSettings) -> KLNeeds:
        raise NotImplementedError

    def per_token(self, policy: TokenStats, anchor: TokenStats, labels: Tensor, *, cfg: KLSettings,
                  old_logp: Tensor | None) -> Tensor:
        """Per-token KL ``(B, T)``; differentiable through ``policy`` only. ``old_logp`` is given when the IW applies."""
        raise NotImplementedError

    def extra_metrics(self, anchor: TokenStats, labels: Tensor, mask: Tensor) -> dict[str, Tensor]:
        return {}

    def loss(
        self,
        policy: TokenStats,
        anchor: TokenStats,
        labels: Tensor,
        loss_mask: Tensor,
        agg: LossAggregation,
        *,
        cfg: KLSettings,
        old_logp: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Aggregated KL(πθ, π_anchor) of one micro-batch (multiply by β yourself) and its metrics.

        ``policy``: the policy's fresh statistics (gathered on the stored q for Top-k; with
        ``exact_kl`` for the exact kinds); ``anchor``: the stored anchor statistics; ``old_logp``:
        log π_old of the sampled tokens (needed when ``cfg.importance_weight``). Metrics
        (detached, token means over the mask): ``kl`` (the aggregated loss), ``kl_token_mean``,
        with the IW ``kl_iw_mean``/``kl_iw_max``, and the kind's own (Top-k: ``kl_tail_frac``).
        """
        iw = cfg.importance_weight and self.uses_importance_weight
        if iw and old_logp is None:
            raise ValueError("importance_weight=True needs old_logp (log π_old of the sampled tokens)")
        per_tok = self.per_token(policy, anchor, labels, cfg=cfg, old_logp=old_logp if iw else None)
        loss = agg(per_tok, loss_mask)
        m = loss_mask.bool()
        metrics = {"kl": loss.detach(), "kl_token_mean": masked_mean(per_tok.detach(), m), **self.extra_metrics(anchor, labels, m)}
        if iw:
            s = importance_weight(policy.logp, old_logp, _iw_clip(cfg))
            metrics["kl_iw_mean"] = masked_mean(s, m)
            metrics["kl_iw_max"] = s[m].max() if m.any() else s.new_tensor(float("nan"))
        return loss, metrics


def _iw_clip(cfg: KLSettings) -> tuple[float | None, float | None] | None:
    return tuple(cfg.iw_clip) if cfg.iw_clip else None  # type: ignore[return-value]


class SampledKL(KLKind):
    """A sampled per-token estimator of :mod:`trainer.algo.kl` (``k1``, ``k3``, ``k3+``, ...) on the sampled token.

    With the IW the whole estimate is multiplied by s (:func:`trainer.algo.kl.sampled_kl`).
    """

    def __init__(self, name: str, estimator: KLEstimator) -> None:
        self.name = name
        self.estimator = estimator

    def expected(self, cfg: KLSettings) -> tuple[Expectation, Expectation]:
        return self.estimator.value_target, self.estimator.grad_target

    def needs(self, cfg: KLSettings) -> KLNeeds:
        return KLNeeds(anchor_tokens=True)

    def per_token(self, policy, anchor, labels, *, cfg, old_logp):
        return sampled_kl(self.name, policy.logp, anchor.logp.detach(), old_logp=old_logp, iw_clip=_iw_clip(cfg))


class TopkKL(KLKind):
    """Top-k reverse / forward KL (paper §2.3–§2.4; :func:`trainer.algo.topk_kl.topk_kl`).

    q is π_old's top-k (reverse) or the anchor's (forward); the head is exact on q, the tail is
    K4 (reverse) / K5 (forward) on the sampled token when it is not in q, weighted by s with the
    IW.  At k = 0 q is empty and the kind is exactly that sampled estimator with the IW
    (proven by enumeration), which needs only the anchor's log-prob of the sampled token.
    """

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.name = f"topk_{direction}"

    def expected(self, cfg: KLSettings) -> tuple[Expectation, Expectation]:
        if not cfg.tail_sampling:  # the truncated KL: the head alone, biased (distillation only)
            return "none", "none"
        if cfg.topk == 0 or cfg.tail_grad == "exact":
            return self.direction, self.direction
        return self.direction, "reverse+grad_mass_q" if self.direction == "reverse" else "forward-grad_mass_q"

    def validate(self, cfg: KLSettings) -> None:
        if cfg.topk < 0:
            raise ConfigError(f"algorithm.kl.topk must be >= 0 for {self.name}, got {cfg.topk}")
        if cfg.enabled and cfg.topk == 0 and not cfg.tail_sampling:
            raise ConfigError("algorithm.kl.topk=0 with algorithm.kl.tail_sampling=false leaves no KL term; disable kl instead")

    def needs(self, cfg: KLSettings) -> KLNeeds:
        if cfg.topk == 0:
            return KLNeeds(anchor_tokens=True)
        return KLNeeds(topk=cfg.topk, topk_of="old" if self.direction == "reverse" else "anchor", anchor_tokens=True)

    def per_token(self, policy, anchor, labels, *, cfg, old_logp):
        if cfg.topk == 0:  # q = ∅: the head is an empty sum, every sampled token is in the tail
            policy, anchor = _empty_topk(policy), _empty_topk(anchor)
        return topk_kl(self.direction, policy, anchor, labels, old_logp=old_logp, iw_clip=_iw_clip(cfg),
                       tail_sampling=cfg.tail_sampling, tail_grad=cfg.tail_grad)

    def extra_metrics(self, anchor, labels, mask):
        if anchor.topk_indices is None:  # k = 0
            return {"kl_tail_frac": torch.ones((), dtype=torch.float32, device=labels.device)}
        return {"kl_tail_frac": masked_mean(not_in_topk_mask(labels, anchor.topk_indices).float(), mask)}


def _empty_topk(st: TokenStats) -> TokenStats:
    """``st`` with zero-width top-k logits and indices ``(B, T, 0)``."""
    return TokenStats(
        logp=st.logp, logsumexp=st.logsumexp, topk_logits=st.logp.new_zeros(*st.logp.shape, 0),
        topk_indices=torch.zeros(*st.logp.shape, 0, dtype=torch.long, device=st.logp.device),
        entropy=st.entropy, exact_kl=st.exact_kl,
    )


class ExactKL(KLKind):
    """The exact full-vocabulary KL at every token, from both models' final hidden states.

    The policy pass computes it (``TokenStats.exact_kl``) from the stored anchor hidden states
    and the anchor's lm_head, chunk by chunk: no (T, V) tensor (:class:`trainer.algo.topk_kl.ExactKLAnchor`).
    """

    uses_importance_weight = False

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.name = f"exact_{direction}"

    def expected(self, cfg: KLSettings) -> tuple[Expectation, Expectation]:
        return self.direction, self.direction

    def needs(self, cfg: KLSettings) -> KLNeeds:
        return KLNeeds(exact=self.direction)

    def per_token(self, policy, anchor, labels, *, cfg, old_logp):
        if policy.exact_kl is None:
            raise ValueError(f"{self.name} needs policy stats with exact_kl (a policy pass given the anchor's hidden states)")
        return policy.exact_kl


_KINDS: dict[str, KLKind] = {}


def register_kl_kind(kind: KLKind) -> KLKind:
    """Add a kind under ``kind.name`` (sampled estimators are found through :mod:`trainer.algo.kl`'s registry)."""
    if kind.name in _KINDS or kind.name in kl_estimator_names():
        raise ValueError(f"KL kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


for _kind in (TopkKL("reverse"), TopkKL("forward"), ExactKL("reverse"), ExactKL("forward")):
    register_kl_kind(_kind)


def kl_kind_names() -> list[str]:
    """Every accepted ``algorithm.kl.type``: Top-k, exact, then the sampled estimators and their aliases."""
    return [*_KINDS, *kl_estimator_names()]


def get_kl_kind(name: str) -> KLKind:
    """The kind called ``name``; sampled estimator names, aliases and ``<name>+`` variants included.

    Raises ``KeyError`` listing the known names.
    """
    if name in _KINDS:
        return _KINDS[name]
    try:
        return SampledKL(name, get_kl_estimator(name))
    except KeyError as e:
        raise KeyError(f"{e.args[0]}; or one of {', '.join(_KINDS)}") from None
