"""Answer flips (``logging.probe_size``): fixed training questions answered greedily as the run goes.

After the first step and every ``logging.probe_every`` steps, the probe questions -- ``logging.probe_size`` of the
run's training questions, drawn once by ``run.seed`` -- are answered greedily (temperature 0, one sample) by the
current weights on the run's engine; ``probe/*`` are :func:`trainer.health_signals.probe_metrics` against the previous
probe of this process (its answers are this concern's state).
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any

from emapg.config import ConfigError
from trainer.data import SampledPrompt

__all__ = ["Probe"]


class Probe:
    """The probe questions of ``cfg`` among ``examples`` (the run's training questions) and their last answers."""

    def __init__(self, cfg: Any, examples: list[Any]) -> None:
        if cfg.rollout.max_staleness:
            raise ConfigError("logging.probe_size works with synchronous training only (rollout.max_staleness=0)")
        self.cfg = cfg
        chosen = random.Random(cfg.run.seed).sample(examples, min(cfg.logging.probe_size, len(examples)))
        self.prompts = [SampledPrompt(ex, f"probe{i}") for i, ex in enumerate(chosen)]
        self.last: list[tuple[str | None, bool]] | None = None  # (answer, correct) at the last probe

    def __call__(self, trainer: Any) -> dict[str, float]:
        """``probe/*`` and ``time/probe`` when this step probes (``trainer``: the run, after its step), else ``{}``."""
        from trainer.health_signals import probe_metrics
        from trainer.sampled_batch import generate, grade

        cfg = self.cfg
        if not self.prompts or (self.last is not None and trainer.step % cfg.logging.probe_every):
            return {}
        greedy = replace(cfg, rollout=replace(cfg.rollout, temperature=0.0, n_samples=1))
        t0 = time.perf_counter()
        with trainer.engine_session.generating(tag=f"probe-{trainer.step}") as engine:
            trajectories, _ = generate(engine, trainer.tokenizer, self.prompts, trainer.retriever, greedy, seed=cfg.run.seed)
        now = [(o.answer, o.reward >= 1.0) for o in grade(trajectories, self.prompts, greedy)]
        metrics = probe_metrics(self.last, now)
        self.last = now
        return {**metrics, "time/probe": time.perf_counter() - t0}
