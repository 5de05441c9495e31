"""The run planner (``emapg plan``): will a config fit, how long will it take, what will it cost.

:mod:`trainer.plan.catalogue` (devices and model shapes), :mod:`trainer.plan.memory` (bytes by component and phase),
:mod:`trainer.plan.timing` (seconds by phase), :mod:`trainer.plan.planner` (the plan, what fits, the knob to turn),
:mod:`trainer.plan.probe` (one or two real steps that measure and refit the rates), :mod:`trainer.plan.cli`.
Nothing but the probe imports torch or loads weights.
"""
