"""Small helpers for error messages."""


def first_line(exc):
    """The first non-empty line of an exception's message, or its repr when it has none
    (`str(e).splitlines()[0]` raises IndexError on an empty message)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return repr(exc)
