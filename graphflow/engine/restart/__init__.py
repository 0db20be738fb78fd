"""Warm restart: a committed run's graphs saved, and built again in a new process
(``run``: ``save`` after commit, ``restore`` in place of capture; docs/engine.md, "Warm
restart")."""
