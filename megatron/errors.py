"""Errors meant for people: one sentence that names the bad input and the fix.

Entry points catch `UserError` and print only its message (no traceback), so every check on
flags, files and data raises a subclass of it before any work is done.
"""


class UserError(Exception):
    """A problem with the user's input (a flag, a file, a data set) that the user can fix."""


class ConfigError(UserError, ValueError):
    """A flag or config value that is invalid or contradicts another. Also a ValueError, which is
    what DeepSpeed raises for a bad argument, so code written against DeepSpeed catches it."""


class DataError(UserError):
    """A data file, tokenizer or corpus that is missing, corrupt or unusable."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not match the model."""


class TrainingStopped(UserError):
    """The run cannot go on without damage (non-finite loss or gradients, every step skipped)."""
