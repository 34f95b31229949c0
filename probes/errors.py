"""The one exception type for user mistakes.

Anything raised as `UserError` reaches the user as one line (`charllm-tui: error: ...`) and a
non-zero exit, never as a traceback. The message says which field, what value, what rule.
"""


class UserError(Exception):
    """A mistake in user input: a bad field, value, file or name."""


def did_you_mean(name, choices, otherwise: str = "", cutoff: float = 0.6) -> str:
    """`; did you mean 'x'?` for the closest valid name, else `otherwise` (another hint, or "")."""
    import difflib

    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else otherwise
