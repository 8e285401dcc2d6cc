"""Helpers for minddp's error messages.

    first_line(exc)                 an exception's first line, for a "Cause: ..." clause
    invariant(holds, what_breaks)   minddp's TORCH_INTERNAL_ASSERT
"""


def first_line(exc):
    """The first line of `exc`'s message, for a "Cause: ..." clause; repr(exc)
    (its type, at least) where the message is empty, as after a bare
    `raise RuntimeError()`."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def invariant(holds, what_breaks):
    """Raise if `holds` is false: a rule of minddp's own code, checked where it must
    hold, as torch's reducer.cpp does with TORCH_INTERNAL_ASSERT. For bugs in
    minddp only; a user's mistake gets an error that names the fix. `what_breaks`
    names the rule and what would go wrong were it let pass; keep it a constant
    string, so a check that holds costs a comparison."""
    if not holds:
        raise RuntimeError(f"minddp internal error (a bug in minddp, not in your code; "
                           f"please report it): {what_breaks}")
