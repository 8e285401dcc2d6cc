"""Helpers for minddp's error messages.

    first_line(exc)                 an exception's first line, for a "Cause: ..." clause
    invariant(holds, what_breaks)   minddp's TORCH_INTERNAL_ASSERT
    warn_as_reducer(message, rank)  a warning where torch's C++ reducer gives one
"""
import sys


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


def warn_as_reducer(message, rank):
    """Print `message` on stderr, as torch's C++ reducer prints its warnings (TORCH_WARN
    from code that Python's warning machinery never sees): not a Python warning, so
    `-W error` or pytest's `filterwarnings = error` cannot turn it into an exception
    where torch's DDP would only print."""
    # One write, newline included: ranks sharing a terminal do not run into each other's line.
    sys.stderr.write(f"[rank{rank}]: minddp reducer: Warning: {message}\n")
    sys.stderr.flush()
