"""SIGTERM stops a command the way Ctrl-C does: the main thread gets an exception, the command's own cleanup and
its one-line report run, and the exit code says which signal it was (130 for Ctrl-C, 143 for SIGTERM)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop, a container's shutdown), raised in the main thread. A subclass of
    KeyboardInterrupt so that every handler that makes a Ctrl-C safe makes it safe too."""


def stopped_how(err: BaseException) -> tuple[str, int]:
    """("terminated", 143) for SIGTERM, ("interrupted", 130) for Ctrl-C: the word the report line uses and the
    exit code (128 + the signal's number, as a shell reports a process the signal killed)."""
    return ("terminated", 128 + signal.SIGTERM) if isinstance(err, Terminated) else ("interrupted", 128 + signal.SIGINT)


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`Terminated` in the main thread (elsewhere, where Python allows no
    handler, nothing changes); the earlier handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
