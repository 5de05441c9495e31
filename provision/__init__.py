"""Provisioning: the engines, retrievers and indexes a command needs, built from specs.

``provision.engines``: a generation engine from an :class:`~provision.engines.EngineSpec`
(colocated vLLM, transformers, remote ``emapg engine serve`` servers) and the
:class:`~provision.engines.EngineSession` a trainer rolls out through (weight sync, sleep/wake,
the rank-0 push to shared servers); ``provision.retrievers.open_retriever``: a retriever client for
running servers or for a server launched on an index folder; ``provision.indexes.ensure_bundled_index``:
the bundled index, reused only when its settings match. Train, eval and demo use these instead of
set-up code of their own.
"""
