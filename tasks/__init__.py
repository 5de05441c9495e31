"""The tasks layer: datasets, answer formats and rewards, shared by training and evaluation.

A reward *is* the evaluation metric: the trainer and the evaluator score a trajectory with the same
function, so a training reward and a reported score can never drift apart.

* :mod:`tasks.datasets` -- the dataset registry and loaders (bundled files, user files, ``hf:`` names);
* :mod:`tasks.qa` -- the search (QA) task: answer extraction, exact match / F1 / cover-EM, retrieval recall;
* :mod:`tasks.math` -- the math task: boxed-answer extraction and grading in killable worker processes;
* :mod:`tasks.rewards` -- per-trajectory rewards for either task (what the trainer calls).

Layering: ``tasks`` imports only the core (``emapg.config``, ``emapg.errors``, ``emapg.paths``,
``emapg.workers``); ``trainer`` and ``eval`` import ``tasks``, never the other way round (enforced by
``tests/test_layering.py``).
"""
