"""Provisioning: engines, retrievers and indexes set up once for train, eval and demo."""
