"""Helpers for minddp's error messages."""


def first_line(exc):
    """The first line of `exc`'s message, for a "Cause: ..." clause; repr(exc)
    (its type, at least) where the message is empty, as after a bare
    `raise RuntimeError()`."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)
