"""SIGTERM / Ctrl-C during training: finish the step, save, leave with a summary line.

While the trainer runs (in the main thread) ``StopSignals`` turns SIGTERM and SIGINT
into a flag; the loop checks it after every step (with several processes, at every
``train.log_every`` boundary, all processes together through ``any_process``), saves
the latest checkpoint, flushes the metrics and returns ``{"stopped_at": step, ...}``.
A second signal of a kind acts as it would have without the trainer.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import numpy as np


class StopSignals:
    """Context manager: SIGTERM and SIGINT set ``received`` (the signal's name) instead of
    ending the process, so the loop can checkpoint and return.

    Only installed in the main thread (elsewhere ``signal.signal`` is not allowed), and
    not for a signal whose current handler is ``SIG_IGN``. A second signal of a kind
    restores the previous handler and delivers the signal to it. The previous handlers
    come back on exit.
    """

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.SIGNALS:
            signum = getattr(signal, name)
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            return
        previous = self._previous.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def any_process(flag: bool) -> bool:
    """True when ``flag`` is set in any process (a collective: all must call it)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))
