"""Per-token sampled KL estimators, registered by descriptive name.

Every estimator is a pure function ``fn(logp, ref_logp) -> kl`` on tensors of shape
``(B, T)``:

* ``logp``: log πθ(p_t) of the sampled token under the *current* policy; carries the gradient.
* ``ref_logp``: log π_ref(p_t) under the anchor (EMA model); treated as a constant.

The returned per-token value is meant to be averaged over tokens sampled from πθ (or from
π_old with the importance weight of :func:`importance_weight`, see :func:`sampled_kl`).
Write ``ℓ = logp − ref_logp = −log w``, ``w = π_ref(p)/πθ(p)`` and ``r = πθ(p)/sg(πθ(p))``
(value 1, gradient ∇log πθ(p)).  What each estimator is worth in expectation over p ~ πθ
(value / gradient), verified by exact enumeration in ``tests/trainer/test_kl.py``:

==================== =========== ====================== ===================== =====================
name                 paper name  per-token value        E[value]              E[gradient]
==================== =========== ====================== ===================== =====================
k1                   K1, ``kl``  ℓ                      KL(πθ‖πref)           0
abs                  ``abs``     |ℓ|                    not a KL              –
k2                   K2, ``mse`` ½ℓ²                    ≠ KL                  ∇KL(πθ‖πref)
k3                   K3,         w − log w − 1          KL(πθ‖πref)           ∇KL(πref‖πθ) (!)
                     low_var_kl
k3_ratio             K3⁺⁺,       r·(w − log w − 1)      KL(πθ‖πref)           ∇KL(πθ‖πref)
                     k3plusplus
reverse_reinforce    K4          r·sg(ℓ)                KL(πθ‖πref)           ∇KL(πθ‖πref)
forward_importance   K5          sg(w)·log w + log r    KL(πref‖πθ)           ∇KL(πref‖πθ)
``<name>+``          verl "+"    value of <name>        E of <name>           ∇KL(πθ‖πref) (k2's)
==================== =========== ====================== ===================== =====================

Clamps follow the paper's code: ``log w`` is clamped to [−20, 20] wherever ``w`` is
exponentiated, and K3/K3⁺⁺ values to [−10, 10].  Exact full-vocabulary and Top-k KL live in
:mod:`trainer.algo.topk_kl`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

__all__ = [
    "KLEstimator",
    "register_kl_estimator",
    "get_kl_estimator",
    "kl_estimator_names",
    "importance_weight",
    "sampled_kl",
    "LOG_RATIO_CLAMP",
    "K3_VALUE_CLAMP",
]

#: log w is clamped to ±20 before ``exp`` (paper code; avoids inf for unlikely tokens).
LOG_RATIO_CLAMP = 20.0
#: K3 / K3⁺⁺ per-token values are clamped to ±10 (paper code, from verl ``low_var_kl``).
K3_VALUE_CLAMP = 10.0

Target = Literal["reverse", "forward", "zero", "none"]


@dataclass(frozen=True)
class KLEstimator:
    """A registered per-token estimator and what it estimates under p ~ πθ.

    ``value_target`` / ``grad_target``: ``"reverse"`` = KL(πθ‖πref), ``"forward"`` =
    KL(πref‖πθ), ``"zero"`` = zero in expectation, ``"none"`` = no KL meaning.
    """

    name: str
    fn: Callable[[Tensor, Tensor], Tensor]
    paper_name: str
    value_target: Target
    grad_target: Target

    def __call__(self, logp: Tensor, ref_logp: Tensor) -> Tensor:
        return self.fn(logp, ref_logp)


_REGISTRY: dict[str, KLEstimator] = {}
_ALIASES: dict[str, str] = {}


def register_kl_estimator(
    name: str,
    *,
    paper_name: str,
    value_target: Target,
    grad_target: Target,
    aliases: tuple[str, ...] = (),
) -> Callable[[Callable[[Tensor, Tensor], Tensor]], Callable[[Tensor, Tensor], Tensor]]:
    """Decorator: register ``fn(logp, ref_logp) -> (B, T)`` under ``name`` (+ aliases)."""

    def deco(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        for key in (name, *aliases):
            if key in _REGISTRY or key in _ALIASES or key.endswith("+"):
                raise ValueError(f"KL estimator name {key!r} is already registered or invalid")
        _REGISTRY[name] = KLEstimator(name, fn, paper_name, value_target, grad_target)
        for alias in aliases:
            _ALIASES[alias] = name
        return fn

    return deco


def kl_estimator_names(include_aliases: bool = True) -> list[str]:
    """All registered names (``<name>+`` straight-through variants exist for each)."""
    names = list(_REGISTRY)
    if include_aliases:
        names += list(_ALIASES)
    return sorted(names)


def get_kl_estimator(name: str) -> KLEstimator:
    """Look up an estimator by name or alias; ``"<name>+"`` gives the straight-through variant.

    The "+" variant (verl's straight-through trick) keeps the *value* of ``<name>`` and takes
    the *gradient* of k2, i.e. an unbiased reverse-KL gradient.  Raises ``KeyError`` listing
    the known names for an unknown one.
    """
    straight_through = name.endswith("+")
    base_key = name[:-1] if straight_through else name
    base_key = _ALIASES.get(base_key, base_key)
    if base_key not in _REGISTRY:
        known = ", ".join(kl_estimator_names())
        raise KeyError(f"unknown KL estimator {name!r}; known: {known} (append '+' for straight-through k2 gradients)")
    base = _REGISTRY[base_key]
    if not straight_through:
        return base

    def st_fn(logp: Tensor, ref_logp: Tensor, _base=base.fn) -> Tensor:
        grad_part = _k2(logp, ref_logp)
        return _base(logp, ref_logp).detach() + grad_part - grad_part.detach()

    return KLEstimator(base.name + "+", st_fn, base.paper_name + "+", base.value_target, "reverse")


def _log_w(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log w = log π_ref − log πθ, clamped to ±20 (paper code)."""
    return torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _score(logp: Tensor) -> Tensor:
    """r = πθ(p)/sg(πθ(p)): value exactly 1, gradient ∇log πθ(p)."""
    return torch.exp(logp - logp.detach())


@register_kl_estimator("k1", paper_name="K1", value_target="reverse", grad_target="zero", aliases=("kl",))
def _k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K1: ℓ = log πθ − log πref. Unbiased value; its gradient (the score) has zero mean."""
    return logp - ref_logp


@register_kl_estimator("abs", paper_name="abs", value_target="none", grad_target="none")
def _abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """|ℓ|: heuristic kept for parity with verl; not an estimator of any KL."""
    return (logp - ref_logp).abs()


@register_kl_estimator("k2", paper_name="K2", value_target="none", grad_target="reverse", aliases=("mse",))
def _k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K2: ½ℓ². Biased value, unbiased reverse-KL gradient (on-policy)."""
    return 0.5 * (logp - ref_logp).square()


@register_kl_estimator(
    "k3", paper_name="K3 (low_var_kl)", value_target="reverse", grad_target="forward", aliases=("low_var_kl",)
)
def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K3: w − log w − 1. Unbiased reverse-KL value, but its gradient is ∇KL(πref‖πθ)."""
    log_w = _log_w(logp, ref_logp)
    return torch.clamp(torch.exp(log_w) - log_w - 1.0, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


@register_kl_estimator(
    "k3_ratio",
    paper_name="K3++ (k3plusplus)",
    value_target="reverse",
    grad_target="reverse",
    aliases=("k3plusplus",),
)
def _k3_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K3⁺⁺: r·K3. Same value as K3; gradient ℓ·∇log πθ, unbiased for the reverse KL."""
    return _score(logp) * _k3(logp, ref_logp)


@register_kl_estimator(
    "reverse_reinforce", paper_name="K4", value_target="reverse", grad_target="reverse", aliases=("k4",)
)
def _reverse_reinforce(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K4: r·sg(ℓ), REINFORCE with reward −ℓ. Unbiased reverse-KL value and gradient."""
    return _score(logp) * (logp - ref_logp).detach()


@register_kl_estimator(
    "forward_importance", paper_name="K5", value_target="forward", grad_target="forward", aliases=("k5",)
)
def _forward_importance(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """K5: sg(w)·log w + log r. Importance-sampled forward KL; unbiased value and gradient."""
    log_w = _log_w(logp, ref_logp)
    return torch.exp(log_w).detach() * log_w + (logp - logp.detach())


def importance_weight(
    logp: Tensor,
    old_logp: Tensor,
    clip: tuple[float | None, float | None] | None = None,
) -> Tensor:
    """s = exp(clamp(sg(log πθ − log π_old), −20, 20)), optionally clipped to ``clip=(lo, hi)``.

    Shapes ``(B, T)`` in and out; the result carries no gradient (paper §2.5).  ``None``
    bounds mean no clipping on that side (the paper's scripts set neither).
    """
    s = torch.exp(torch.clamp((logp - old_logp).detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if clip is not None and (clip[0] is not None or clip[1] is not None):
        s = torch.clamp(s, min=clip[0], max=clip[1])
    return s


def sampled_kl(
    name: str,
    logp: Tensor,
    ref_logp: Tensor,
    old_logp: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] | None = None,
) -> Tensor:
    """Per-token sampled KL ``(B, T)`` by estimator name, optionally importance weighted.

    With ``old_logp`` (log π_old of the sampled tokens) the whole estimate is multiplied by
    s = πθ/π_old (:func:`importance_weight`), which makes it unbiased when the tokens were
    sampled from π_old rather than πθ (the paper's ``use_kl_iw``).
    """
    kl = get_kl_estimator(name)(logp, ref_logp)
    if old_logp is not None:
        kl = importance_weight(logp, old_logp, iw_clip) * kl
    return kl
