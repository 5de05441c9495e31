"""Provisioning: the engines, retrievers and indexes a command needs, built from specs.

``provision.engines``: a generation engine from an :class:`~provision.engines.EngineSpec`
(colocated vLLM, transformers, remote ``emapg engine serve`` servers) and the
:class:`~provision.engines.EngineSession` a trainer rolls out through (weight sync, sleep/wake,
the rank-0 push to shared servers). Train, eval and demo use these instead of their own set-up.
"""
