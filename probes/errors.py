"""The one exception type for user mistakes.

Anything raised as `UserError` reaches the user as one line (`charllm-tui: error: ...`) and a
non-zero exit, never as a traceback. The message says which field, what value, what rule.
"""


class UserError(Exception):
    """A mistake in user input: a bad field, value, file or name."""
