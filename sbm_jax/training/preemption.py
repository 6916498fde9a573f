"""SIGTERM / Ctrl-C / hang-up during training: finish the step, save, leave with a
summary line.

While the trainer runs (in the main thread) ``StopSignals`` turns SIGTERM, SIGINT and
SIGHUP (the terminal closed: an ssh session dropped without ``nohup``) into a flag; the
loop checks it after every step (with several processes, at every ``train.log_every``
boundary, all processes together through ``any_process``), saves the latest checkpoint,
flushes the metrics and returns ``{"stopped_at": step, ...}``. A watcher thread says at
once on stderr that the first signal was heard ("heard SIGTERM: stopping after the step
in progress, then saving"), even while a long first compile or step keeps the loop
away. A second signal acts as it would have without the trainer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np


class StopSignals:
    """Context manager: SIGTERM, SIGINT and SIGHUP set ``received`` (the signal's name)
    instead of ending the process, so the loop can checkpoint and return.

    After a SIGHUP the terminal is gone, and writing to it fails (``EIO``): standard
    output and error that were terminals on entry are pointed at ``os.devnull`` first, so that a
    progress line cannot crash the run before it saves. Output redirected to a file is
    left alone; the run's records are in its folder either way.

    Only installed in the main thread (elsewhere ``signal.signal`` is not allowed), and
    not for a signal whose current handler is ``SIG_IGN``. A second signal of a kind
    restores the previous handler and delivers the signal to it. The previous handlers
    come back on exit.
    """

    SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")

    def __init__(self, stream_fd: int = 2) -> None:
        self.received: str | None = None
        #: ``time.monotonic()`` when the first signal was acknowledged on ``stream_fd``.
        self.heard_at: float | None = None
        self._stream_fd = stream_fd
        self._terminals: list[int] = []
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        # Asked now: once the terminal has hung up, isatty() on it is False.
        self._terminals = [fd for fd in (1, 2) if _isatty(fd)]
        for name in self.SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:  # no SIGHUP on Windows
                continue
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        self._start_watcher()
        return self

    def _start_watcher(self) -> None:
        """Acknowledge the first signal at once, from a thread: Python runs ``_handle``
        only when the main thread is back in the interpreter, which a long first
        compile or step keeps it from for minutes. The C-level handler writes each
        signal's number to the wake-up fd at once; the thread reads it there."""
        if not self._previous:
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return
        self._wakeup = (read, write)
        ours = set(self._previous)

        def watch() -> None:
            while True:
                try:
                    data = os.read(read, 64)
                except OSError:
                    return
                if not data:
                    return
                for signum in data:
                    if signum in ours and self.heard_at is None:
                        self.heard_at = time.monotonic()
                        name = signal.Signals(signum).name
                        if name == "SIGHUP":  # no terminal to write to
                            continue
                        message = (
                            f"heard {name}: stopping after the step in progress, then saving "
                            f"(a second {name} stops at once, without saving)\n"
                        )
                        with contextlib.suppress(OSError):
                            os.write(self._stream_fd, message.encode())

        self._watcher = threading.Thread(target=watch, name="stop-signals", daemon=True)
        self._watcher.start()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            if self.received == "SIGHUP":
                detach_terminal(self._terminals)
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
        if self._wakeup is not None:
            read, write = self._wakeup
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(self._previous_wakeup)
            os.close(write)  # the watcher reads end-of-file and returns
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            os.close(read)
            self._wakeup = None


#: What a write to a terminal that has hung up fails with (``EIO`` on Linux; ``ENXIO``
#: and ``EPIPE`` for other kinds of vanished terminal).
_HANGUP_ERRNOS = (errno.EIO, errno.ENXIO, errno.EPIPE)


class HangupSafe:
    """A text stream that survives its terminal hanging up: a write or flush that fails
    because the terminal is gone points standard output and error that are terminals at
    ``os.devnull`` (as :class:`StopSignals` does on SIGHUP) and drops the text, instead of
    crashing the run in the moment between the hang-up and the SIGHUP's handler (the
    trainer must still save and exit cleanly). Any other error is raised."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def _hung_up(self, err: OSError) -> bool:
        if err.errno not in _HANGUP_ERRNOS:
            return False
        self._gone = True
        detach_terminal([fd for fd in (1, 2) if _isatty(fd)] or [])
        return True

    def write(self, text: str) -> int:
        if self._gone:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as err:
            if not self._hung_up(err):
                raise
            return len(text)

    def flush(self) -> None:
        if self._gone:
            return
        try:
            self._stream.flush()
        except OSError as err:
            if not self._hung_up(err):
                raise

    def isatty(self) -> bool:
        return not self._gone and bool(getattr(self._stream, "isatty", lambda: False)())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def detach_terminal(targets: list[int]) -> None:
    """Point the file descriptors ``targets`` (those of 1 and 2 that were terminals) at
    ``os.devnull``."""
    # Not flushed first: what Python still buffers could not reach the closed terminal
    # anyway, and a flush inside a signal handler can re-enter a write in progress.
    if not targets:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in targets:
            os.dup2(null, fd)
    finally:
        os.close(null)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def any_process(flag: bool) -> bool:
    """True when ``flag`` is set in any process (a collective: all must call it)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))
