"""What every rank of ``phalanx run`` and of the ``subprocess`` launcher runs:
``python -m phalanx_torch._launch.rank_program SCRIPT ARGS...`` (or ``-m MODULE
ARGS...``): core's :mod:`phalanx_core.launching.rank_program` (the rank dies
with its launching process, Ctrl-C ends it quietly, a program that raises
leaves at once, one that ends leaves without Python's finalization), plus
the program's exception recorded in torch elastic's error file, where the
launching process reads it; under ``phalanx run``, a rank that lost a peer
writes its error's last line only (the launcher prints the whole traceback
where that rank's failure is the job's first). Imports no torch itself; the program does.
"""

from __future__ import annotations

import contextlib
import os
import sys

from phalanx_core.launching import LINES_PREFIXED_VAR, RANK_MACHINERY
from phalanx_core.launching.rank_program import run_as_rank

#: Its frames are left out of tracebacks and hang reports.
globals()[RANK_MACHINERY] = True


def _record(exc: BaseException) -> None:
    """Leave the traceback in torch elastic's error file, where the
    launching process reads it, unless the failing launch left it there."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    with contextlib.suppress(Exception):
        from .ranks import record_exception

        record_exception(exc)


if __name__ == "__main__":
    # Under phalanx run, whose launcher prints the first failure's whole
    # traceback where that rank left it out.
    run_as_rank(
        sys.argv[1:], on_error=_record, peer_lost_in_one_line=bool(os.environ.get(LINES_PREFIXED_VAR))
    )
