"""Waiting on a condition instead of sleeping: poll a predicate at a short interval until it holds, and fail naming
what was awaited (and the last value seen) when it does not hold within a bound.

A fixed sleep is either too short on a busy machine (the test fails for no fault) or too long everywhere (the
suite is slow); a bounded poll returns as soon as the state is reached and keeps the test able to fail.
"""
import time


def wait_for(predicate, what: str, timeout: float = 10.0, interval: float = 0.005):
    """Poll ``predicate()`` until it returns a true value, and return that value. After ``timeout`` seconds
    without one, fail with an AssertionError naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"not reached within {timeout} s: {what}")
        time.sleep(interval)


def wait_equal(fn, want, what: str, timeout: float = 10.0, interval: float = 0.005):
    """Poll ``fn()`` until it equals ``want`` and return it; fail naming ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got == want:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"not reached within {timeout} s: {what} == {want!r} (last seen: {got!r})")
        time.sleep(interval)
