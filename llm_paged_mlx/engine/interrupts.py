"""Ctrl-C held back while the engine changes its books, let through while it waits for the device.

Python raises KeyboardInterrupt in the main thread between any two bytecodes, so
one could land halfway through handing a step's tokens to their requests and
leave them half done. While ``held`` is active, SIGINT is only recorded; it is
raised where the engine's state is whole: when ``allowed`` begins (the wait for
the device, which a transaction undoes if it is interrupted) or when ``held``
ends. In other threads, and under a handler that is not Python's default, there
is nothing to hold: SIGINT reaches only the main thread, and a custom handler is
its owner's business.
"""

import contextlib
import signal
import threading
from typing import Iterator


class HeldInterrupts:
    def __init__(self):
        self.pending = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Record SIGINT instead of raising it; raise it (KeyboardInterrupt) once the block ends."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # held already, or not ours
            yield
            return
        signal.signal(signal.SIGINT, self._record)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._raise_pending()

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """Inside ``held``: raise a recorded SIGINT now, and let a new one through at once."""
        if signal.getsignal(signal.SIGINT) != self._record:
            yield
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self._raise_pending()
            yield
        finally:
            signal.signal(signal.SIGINT, self._record)

    def _record(self, signum, frame) -> None:
        self.pending = True

    def _raise_pending(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt
