"""StopRequest with real signals sent to this process: SIGTERM/SIGUSR1/SIGINT ask for a graceful stop,
a second SIGINT aborts at once."""

from __future__ import annotations

import os
import signal

import pytest

from miles_lite.run.stop import StopRequest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_first_signal_asks_for_a_graceful_stop(sig: signal.Signals, capsys: pytest.CaptureFixture[str]) -> None:
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), sig)  # the handler runs before the next bytecode
        assert stop.requested and stop.name == sig.name
        assert f"received {sig.name}; stopping after this step" in capsys.readouterr().out
    finally:
        stop.restore()
    assert signal.getsignal(sig) is not stop._handle


def test_second_interrupt_aborts_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # any stop already asked: Ctrl-C now aborts
        assert "aborting now" in capsys.readouterr().out
    finally:
        stop.restore()
