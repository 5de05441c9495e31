"""The tasks layer: datasets, answer formats and rewards, shared by training and evaluation.

A reward *is* the evaluation metric: the trainer and the evaluator score a trajectory with the same
function, so a training reward and a reported score can never drift apart.

* :mod:`tasks.datasets` -- the dataset registry and loaders (bundled files, user files, ``hf:`` names);
* :mod:`tasks.qa` -- the search (QA) task: answer extraction, exact match / F1 / cover-EM, retrieval recall;
* :mod:`tasks.math` -- the math task: boxed-answer extraction and grading in killable worker processes;
* :mod:`tasks.passk` -- the unbiased pass@k estimator (math metrics);
* :mod:`tasks.task` -- the two tasks as objects (:data:`tasks.task.QA`, :data:`tasks.task.MATH`): datasets,
  prompt template, grading (the reward), per-item scores and metric names; what the agent loop, the trainer,
  the evaluator and SFT ask of a task. :func:`tasks.task.get_task` maps every name users type to one.

Layering: ``tasks`` imports only the core (``emapg.config``, ``emapg.errors``, ``emapg.paths``,
``emapg.workers``); ``trainer`` and ``eval`` import ``tasks``, never the other way round (enforced by
``tests/test_layering.py``).
"""
