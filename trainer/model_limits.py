"""Settings whose bound is the model: checked against its ``config.json`` before anything starts.

The config schema checks every option's own range (:mod:`emapg.config`); a few bounds are the
policy's: the Top-k KL's ``k`` cannot exceed its vocabulary, and no prompt or response budget can
exceed its context window (``max_position_embeddings``). ``emapg train`` and ``emapg sft`` call
:func:`check_model_limits` once the model name is resolved, before any engine, retriever or weight
loads, so such a setting costs one line naming the key and the bound instead of a traceback after
the first rollout.
"""

from __future__ import annotations

from typing import Any

from emapg.config import ConfigError

#: The rollout budgets (tokens) the model's context bounds.
BUDGETS = ("max_prompt_tokens", "max_response_tokens", "max_tokens_per_turn", "max_obs_tokens", "max_context_tokens")


def model_limits(model_path: str) -> tuple[int | None, int | None]:
    """(vocabulary size, context length) from the model folder's config (None where it does not say)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.policy: cannot read the model's config in {model_path}: {e}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None), getattr(text, "max_position_embeddings", None)


def check_model_limits(cfg: Any, model_path: str) -> None:
    """ConfigError naming the first setting of ``cfg`` (a ``TrainConfig`` or ``SFTConfig``) that the
    model at ``model_path`` cannot honour."""
    vocab, context = model_limits(model_path)
    where = f"the model {cfg.model.policy}"
    kl = getattr(getattr(cfg, "algorithm", None), "kl", None)
    if kl is not None and vocab:
        from trainer.algo.kl_kinds import get_kl_kind

        topk = get_kl_kind(kl.type).needs(kl).topk
        if topk > vocab:
            raise ConfigError(f"algorithm.kl.topk: {topk} exceeds the vocabulary size {vocab} of {where}")
    if context:
        for name in BUDGETS:
            value = getattr(cfg.rollout, name)
            if value is not None and value > context:
                raise ConfigError(f"rollout.{name}: {value} tokens exceed the context of {where} "
                                  f"({context} tokens, max_position_embeddings)")
        if cfg.rollout.max_prompt_tokens >= context:
            raise ConfigError(f"rollout.max_prompt_tokens: {cfg.rollout.max_prompt_tokens} tokens leave no room for a "
                              f"response in the context of {where} ({context} tokens)")
