"""One rank: ``python -m phalanx_popen._rank FOLDER``. Runs ``fn`` from
``FOLDER/job.pkl`` and leaves ``FOLDER/<rank>.pkl`` (its result) or
``FOLDER/<rank>.err`` (its traceback and when it raised), each whole."""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path

from phalanx_core.launching import die_with_parent, dumps_result, exit_process, failure_text, write_whole

from .launcher import PARENT_VAR


def main(folder: Path) -> int:
    die_with_parent(int(os.environ[PARENT_VAR]))  # even if the launcher is killed by SIGKILL
    rank = os.environ["RANK"]
    try:
        fn, args, kwargs = pickle.loads((folder / "job.pkl").read_bytes())
        result = dumps_result(fn(*args, **kwargs), rank)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank exits 1
        text = failure_text(exc)
        write_whole(folder / f"{rank}.err", json.dumps({"traceback": text, "when": time.time()}).encode())
        return 1
    write_whole(folder / f"{rank}.pkl", result)
    return 0


if __name__ == "__main__":
    # Not through the interpreter's finalization, where gloo's threads can
    # abort a finished rank.
    exit_process(main(Path(sys.argv[1])))
