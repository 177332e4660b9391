"""While a spawned job runs, SIGTERM to the script raises ``SystemExit`` in its main thread, so
``with`` blocks, ``finally`` clauses and exit handlers run and end the job (Python's default
for SIGTERM is to die at once, leaving them unrun). The handler goes in only over the default
one (a script's or a server's own handler is left alone) and only from the main thread (only it
may install one), and goes again when the last job holding it ends (from the main thread)."""
from __future__ import annotations

import signal
import threading

_lock = threading.Lock()
_holders = 0
_installed = False


def hold() -> None:
    global _holders, _installed
    with _lock:
        _holders += 1
        if _installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_signal)
            _installed = True


def release() -> None:
    global _holders, _installed
    with _lock:
        _holders -= 1
        if _holders or not _installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _exit_on_signal:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed = False


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)
