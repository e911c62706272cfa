"""The one error type of environment definitions and runs."""
from __future__ import annotations


class EnvError(ValueError):
    """A bad environment: unknown name, failing import, a class that does not implement the
    interface, an option it does not take, an exception inside its reset/step (naming the
    env and the instance's seed) or a wrong return type (naming the field). One line."""
