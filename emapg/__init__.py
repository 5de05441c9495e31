"""ema-pg: RL for LLM search agents and math reasoners with EMA-PG (arXiv 2602.04417).

This package is two floors of the building:

* the **core**, which every package may import and which imports none of them: ``emapg.config``
  (typed configs, argparse generation), ``emapg.errors`` (``UserError``, ``ConfigError``),
  ``emapg.paths``, ``emapg.atomic`` (atomic writes), ``emapg.process_group`` (stopping a child and all it started), ``emapg.servers`` (what the HTTP servers and their
  launchers share), ``emapg.models`` (model resolution), ``emapg.workers`` (the killable worker pool);
* the **application**, the ``emapg`` command: :data:`APP_MODULES` here, plus every package's ``cli``
  module (``retriever.cli``, ``trainer.cli``, ``eval.cli``, ``agent.engines.cli``). Application
  modules may import anything; no library module imports them.

The layers between, bottom to top: ``tasks`` (datasets, answer formats, rewards) and ``retriever``;
``agent``; ``provision`` (engines, retrievers, indexes set up for a run); ``trainer`` and ``eval``.
``tests/test_layering.py`` reads every module's imports and enforces this.
"""

__version__ = "0.1.0"

#: The application modules of this package (the command line); library modules never import them.
APP_MODULES: tuple[str, ...] = ("emapg.cli", "emapg.demo", "emapg.config_cli", "emapg.model_cli")
