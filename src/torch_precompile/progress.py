"""Progress of a build, as records of the ``torch_precompile.progress`` logger.

A build takes from seconds to minutes, so each step (trace, lower, the kernel objects packed,
the artifact written) is logged at INFO when it starts and when it ends, with its time. Where
no handler of the process would show them (none on this logger's parents or the root), they
go to stderr: redrawn in place on a terminal, one plain line each otherwise. Silence them with
``logging.getLogger("torch_precompile.progress").setLevel(logging.WARNING)`` (or the same on
``"torch_precompile"``, which quiets every message of the package).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO, cast

log = logging.getLogger("torch_precompile.progress")


class StderrProgress(logging.Handler):
    """Shows progress records on stderr, where no other handler of the process would: one
    plain line each, or on a terminal, a line redrawn in place with a running clock until the
    step ends."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._ticking: threading.Event | None = None  # set to stop the open line's clock

    def emit(self, record: logging.LogRecord) -> None:
        if _handled_elsewhere(record.name):
            return
        stream = sys.stderr
        text = f"torch-precompile: {record.getMessage()}"
        if not stream.isatty():
            stream.write(text + "\n")
            stream.flush()
            return
        if self._ticking is not None:
            self._ticking.set()
            self._ticking = None
        ends = getattr(record, "ends_step", True)
        with cast(threading.RLock, self.lock):  # created by Handler.__init__
            stream.write(f"\r\033[K{text}" + ("\n" if ends else ""))
            stream.flush()
        if not ends:
            self._ticking = threading.Event()
            threading.Thread(
                target=self._tick, args=(stream, text, self._ticking), daemon=True
            ).start()

    def _tick(self, stream: TextIO, text: str, stop: threading.Event) -> None:
        started = time.perf_counter()
        while not stop.wait(0.5):
            with cast(threading.RLock, self.lock):  # created by Handler.__init__
                if not stop.is_set():
                    stream.write(f"\r\033[K{text} {time.perf_counter() - started:.1f} s")
                    stream.flush()


def _handled_elsewhere(name: str) -> bool:
    """Whether a record of logger ``name`` reaches a handler of its ancestors."""
    logger = logging.getLogger(name)
    while logger.propagate and logger.parent is not None:
        logger = logger.parent
        if logger.handlers:
            return True
    return False


@contextlib.contextmanager
def step(text: str) -> Iterator[None]:
    """Log ``text`` as a step starting now, then its end with the time it took."""
    started = time.perf_counter()
    log.info("%s...", text, extra={"ends_step": False})
    try:
        yield
    except BaseException:
        log.info("%s: failed after %.1f s", text, time.perf_counter() - started)
        raise
    log.info("%s: done in %.1f s", text, time.perf_counter() - started)


def count(text: str, done: int, total: int) -> None:
    """Log that ``done`` of ``total`` items of a step are done."""
    log.info("%s: %d of %d", text, done, total, extra={"ends_step": done == total})


def _package_level_allows(record: logging.LogRecord) -> bool:
    """A level set on the package's logger ("torch_precompile") quiets its progress too."""
    level = logging.getLogger("torch_precompile").level
    return level == logging.NOTSET or record.levelno >= level


def _default_setup() -> None:
    # Only where the process has said nothing about this logger: a level or a handler set
    # by the caller is theirs.
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers:
        log.addHandler(StderrProgress())
    log.addFilter(_package_level_allows)


_default_setup()
