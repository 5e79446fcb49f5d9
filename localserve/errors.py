"""The one exception type for errors a user can cause (bad file, bad request, unknown model).

Its message says what is wrong and what to do; the server maps it to OpenAI-style
error JSON, the CLI prints it without a traceback.
"""


class LocalserveError(Exception):
    """An error caused by input (a file, a request, a name), not by a bug."""


class InsufficientMemoryError(LocalserveError):
    """A model does not fit in the memory left (unloading another may make room)."""
