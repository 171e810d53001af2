"""``transport.fabric.spin.AdaptiveSpin``: a spin stays on while what it waits for comes within it and the waiting
thread gets a core when it wants one; misses or a busy host turn it off for a number of waits that doubles while the
condition holds; a good window resets that number. Driven with synthetic hits, misses and host readings."""
import os
import threading

import pytest

from transport.fabric import spin as S
from transport.fabric.spin import AdaptiveSpin


@pytest.fixture
def idle(monkeypatch):
    """The host reads as idle (no run delay) unless a test sets ``share[0]``."""
    share = [0.0]
    monkeypatch.setattr(S, "run_delay_share", lambda: share[0])
    return share


def _window(sp, hits=AdaptiveSpin.WINDOW, misses=0):
    for _ in range(misses):
        assert sp.until(1.0) == 1.0 + sp.budget
        sp.done(False)
    for _ in range(hits):
        assert sp.until(1.0) == 1.0 + sp.budget
        sp.done(True)


def _skipped(sp) -> int:
    """Waits until the spin is on again (each one told not to spin)."""
    n = 0
    while not sp.on:
        assert sp.until(5.0) == 0.0
        n += 1
        assert n <= AdaptiveSpin.BACKOFF_MAX
    return n


def test_acks_within_the_spin_on_an_idle_host_keep_it_on(idle):
    sp = AdaptiveSpin(150e-6)
    for _ in range(20):
        _window(sp)
    assert sp.on and sp.offs == 0 and sp.spins == sp.hits == 20 * AdaptiveSpin.WINDOW
    assert sp.until(2.0) == pytest.approx(2.0 + 150e-6)


def test_slow_acks_turn_the_spin_off_with_a_doubling_backoff(idle):
    sp = AdaptiveSpin(150e-6)
    _window(sp, hits=0, misses=AdaptiveSpin.MISSES + 1)  # one miss more than a window allows: off at once
    assert not sp.on and sp.offs == 1 and sp.busy_offs == 0 and sp.spins == AdaptiveSpin.MISSES + 1
    assert _skipped(sp) == AdaptiveSpin.BACKOFF_MIN
    backoffs = []
    for _ in range(8):  # slow acks go on: each trial window misses again, the pause doubles up to its cap
        _window(sp, hits=0, misses=AdaptiveSpin.MISSES + 1)
        backoffs.append(_skipped(sp))
    assert backoffs == [min(AdaptiveSpin.BACKOFF_MIN << (i + 1), AdaptiveSpin.BACKOFF_MAX) for i in range(8)]
    _window(sp)  # fast acks again: one good window, the next miss run pauses the shortest time
    assert sp.on
    _window(sp, hits=0, misses=AdaptiveSpin.MISSES + 1)
    assert _skipped(sp) == AdaptiveSpin.BACKOFF_MIN


def test_a_few_misses_in_a_window_keep_the_spin_on(idle):
    sp = AdaptiveSpin(150e-6)
    for _ in range(10):
        _window(sp, hits=AdaptiveSpin.WINDOW - AdaptiveSpin.MISSES, misses=AdaptiveSpin.MISSES)
    assert sp.on and sp.offs == 0


def test_a_busy_host_turns_the_spin_off(idle):
    sp = AdaptiveSpin(150e-6)
    _window(sp)
    assert sp.on
    idle[0] = 0.4  # the waiting thread spent 40 % of the window runnable without a core
    _window(sp)
    assert not sp.on and sp.offs == 1 and sp.busy_offs == 1
    assert _skipped(sp) == AdaptiveSpin.BACKOFF_MIN
    _window(sp)  # still busy: off again, twice as long
    assert _skipped(sp) == 2 * AdaptiveSpin.BACKOFF_MIN and sp.busy_offs == 2
    idle[0] = AdaptiveSpin.BUSY_SHARE / 2
    _window(sp)
    _window(sp)
    assert sp.on and sp.busy_offs == 2
    idle[0] = None  # no reading (not Linux): only the misses decide
    _window(sp)
    assert sp.on


def test_a_zero_budget_never_spins_and_a_bad_one_is_refused():
    sp = AdaptiveSpin(0.0)
    assert not sp.on and sp.until(3.0) == 0.0
    for bad in (-1e-6, 1.5):
        with pytest.raises(ValueError, match=repr(bad)):
            AdaptiveSpin(bad)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="no schedstat (not Linux)")
def test_run_delay_share_reads_this_thread_and_closes_its_file():
    def fds():
        return len(os.listdir("/proc/self/fd"))

    out = []

    def work():
        out.append(S.run_delay_share())
        sum(range(200000))
        out.append(S.run_delay_share())

    before = fds()
    th = threading.Thread(target=work)
    th.start()
    th.join(10)
    assert out[0] is None and isinstance(out[1], float) and 0.0 <= out[1] < 10.0, out
    assert fds() <= before  # the thread's schedstat file went with the thread
