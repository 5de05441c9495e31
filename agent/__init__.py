"""Search-agent rollouts: prompt templates, action parsing, engines, the multi-turn loop.

Public API (stable; the trainer and eval call these):

* ``agent.engines.make_engine(kind, model_path, **options) -> Engine`` and
  ``agent.engines.SamplingParams`` / ``GenerationOutput``;
* ``agent.rollout.RolloutConfig``, ``Trajectory``, ``run_rollouts(engine, prompts, retriever, config)``,
  ``run_rollouts_with_stats``, ``summarize``;
* ``agent.prompts.build_prompt`` / ``TEMPLATES``; ``agent.actions.parse_action``.
"""
