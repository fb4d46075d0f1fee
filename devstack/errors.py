"""The one error of the local stack, in a module of its own so that every part of ``devstack`` (``config`` and
``hosts`` among them) can raise it without importing another part."""

from __future__ import annotations


class StackError(RuntimeError):
    """The local stack could not start, check or stop a process (the message says why)."""
