"""SIGTERM and a hang-up end eval and check as Ctrl-C does (verbs/_signals.py): a
KeyboardInterrupt inside, an ignored signal left ignored (nohup), the handlers given back."""

import os
import signal
import time

import pytest

from dflash_tui.verbs._signals import as_interrupt


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminating_signal_is_an_interrupt_inside_and_the_default_after(sig):
    before = signal.getsignal(sig)
    assert before is signal.SIG_DFL
    with pytest.raises(KeyboardInterrupt):
        with as_interrupt():
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler runs at once: never slept through
    assert signal.getsignal(sig) is before


def test_a_hang_up_the_user_ignored_stays_ignored():
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
    try:
        with as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
