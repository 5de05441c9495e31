"""ema-pg: RL for LLM search agents and math reasoners with EMA-PG (arXiv 2602.04417).

This package is the ground floor of the building, the **core**, which every package may import and which
imports none of them: ``emapg.config`` (typed configs, argparse generation), ``emapg.errors`` (``UserError``,
``ConfigError``), ``emapg.paths``, ``emapg.atomic`` (atomic writes), ``emapg.process_group`` (stopping a child
and all it started), ``emapg.servers`` (what the HTTP servers and their launchers share), ``emapg.models``
(model resolution), ``emapg.workers`` (the killable worker pool).

The top floor is the **application**, the ``emapg`` command: the ``app`` package (:data:`APP_PACKAGE`:
``app.cli`` dispatches, ``app.demo``, ``app.config_cli``, ``app.model_cli``) plus every package's ``cli``
module (``retriever.cli``, ``trainer.cli``, ``eval.cli``, ``agent.engines.cli``). Application modules may
import anything; no library module imports them.

The layers between, bottom to top: ``tasks`` (datasets, answer formats, rewards) and ``retriever``;
``agent``; ``provision`` (engines, retrievers, indexes set up for a run); ``trainer`` and ``eval``.
``tests/test_layering.py`` reads every module's imports and enforces this.
"""

__version__ = "0.1.0"

#: The application package (the ``emapg`` command); no library module imports it.
APP_PACKAGE = "app"
#: The module whose ``main(argv)`` is the ``emapg`` command, named as a string so the core never imports it
#: (``emapg.servers.emapg_command`` runs it in subprocesses).
CLI_MODULE = f"{APP_PACKAGE}.cli"
