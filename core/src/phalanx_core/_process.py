"""Ending a process the way phalanx's ranks and ``phalanx run`` end."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

__all__ = ["exit_process"]


def exit_process(code: int, *, run_atexit: bool = True) -> NoReturn:
    """End this process with ``code``, after what Python's own exit does
    that matters (the non-daemon threads joined, the ``atexit`` handlers
    run, stdout and stderr flushed), but without the interpreter's
    finalization.

    Why, in a rank: gloo's worker threads (``pt_gloo_runloop``) release the
    tensors of a finished operation a moment after the waiting thread has
    woken up. If the interpreter is finalizing by then, the release takes
    the GIL, the finalizing interpreter ends that thread with
    ``pthread_exit``, and the unwinding through a ``noexcept`` destructor
    calls ``std::terminate``: the rank dies by SIGABRT ("terminate called
    without an active exception") after its work was done. It happens with
    plain torch and ``destroy_process_group()`` too (torch never fixed it:
    pytorch#179291 was abandoned). ``os._exit`` ends every thread at once,
    with no finalization in which a thread could be ended that way.

    Why, in ``phalanx run``: a process that imported torch spends 0.3-0.8 s
    of its finalization tearing torch's modules down, after the job is done.

    ``run_atexit=False`` in a forked child: the handlers it has are its
    parent's (a notebook's), not its own.
    """
    import threading

    with contextlib.suppress(BaseException):
        main = threading.main_thread()
        for thread in threading.enumerate():
            if thread is not main and not thread.daemon and thread is not threading.current_thread():
                thread.join()
    if run_atexit:
        import atexit

        # Each handler's exception is printed, as at a normal exit, and does
        # not change the exit code.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    os._exit(code)
