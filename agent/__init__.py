"""Search-agent rollouts: prompt templates, action parsing, engines, the multi-turn loop.

Public API (stable; the trainer and eval call these):

* ``agent.engines.make_engine("vllm" | "hf", model_path, **options) -> Engine`` with
  ``generate(prompt_ids, SamplingParams | list[SamplingParams]) -> list[GenerationOutput]``,
  ``submit``/``step``/``has_unfinished`` (continuous batching), ``score(token_ids, start)``,
  ``load_weights(state_dict)``, ``sleep()``, ``wake()``, ``close()``, ``.tokenizer``, ``.info``;
* ``agent.rollout``: ``RolloutConfig``, ``Trajectory``, ``run_rollouts(engine, prompts, retriever, config)``,
  ``run_rollouts_with_stats`` (+ ``RolloutStats``), ``summarize``;
* ``agent.prompts``: ``build_prompt``, ``TEMPLATES``, ``register_template``;
* ``agent.actions``: ``parse_action``, ``format_passages``, the observation texts;
* ``agent.scripted``: tiny models whose weights script a behaviour (tests, benchmarks).
"""
