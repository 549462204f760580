"""rowrelay's one error root. Dagster-free: every layer's product errors derive from it."""

from __future__ import annotations


class RowrelayError(Exception):
    """Base of every error rowrelay raises for a reason it can name; the message says what to do. Subclasses keep
    the builtin base they had (`ValueError`, `RuntimeError`), so code catching those still catches them."""
