"""Errors every layer may raise: :class:`UserError` (a mistake the user can fix) and :class:`ConfigError`.

The ``emapg`` command prints either as one line and exits with code 2, with no traceback. They live in
the core so that library modules never import the command-line module (the application layer).
"""

from __future__ import annotations

from emapg.config import ConfigError


class UserError(Exception):
    """A mistake the user can fix (bad path, bad option): printed as one line, exit code 2."""


__all__ = ["ConfigError", "UserError"]
