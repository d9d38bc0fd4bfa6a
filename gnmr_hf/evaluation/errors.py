"""The evaluation's one error type."""


class EvalError(Exception):
    """A user mistake (bad task name, adapter, data folder); the CLI prints it and exits with 2."""
