"""Ctrl-C and SIGTERM during cleanup: held, never lost, never in place of another error."""

from __future__ import annotations

import os
import signal

import pytest

from experiments.runtime.procs import Terminated, signals_deferred


def test_a_signal_during_cleanup_is_raised_once_cleanup_is_done():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)  # held: the cleanup goes on
            done.append("cleanup finished")
    assert done == ["cleanup finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_during_cleanup_is_raised_as_terminated_and_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_held_signal_never_replaces_the_error_already_on_its_way():
    with pytest.raises(RuntimeError, match="the first error"):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise RuntimeError("the first error")
    with signals_deferred():  # and nothing is left held for the next cleanup
        pass


def test_a_held_signal_in_cleanup_after_sigterm_keeps_the_sigterm():
    """SIGTERM's cleanup (an __exit__ it passes through) with a Ctrl-C meanwhile: the run
    still ends as stopped by SIGTERM."""
    class Link:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Terminated):
        with Link():
            raise Terminated
