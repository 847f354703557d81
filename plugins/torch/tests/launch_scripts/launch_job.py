"""The script the subprocess launcher re-runs, in test_launchers.py.

``python launch_job.py FN [--arg A ...] [--processes N] [--nodes N] [--listen-on ADDRESS]
[--max-restarts N] [--launches N] [--launcher subprocess|spawn|fork]``
launches ``rank_fns.FN(*args)`` with that launcher (default subprocess) on
the ``local`` environment; ``--strategy NAME``
launches ``rank_fns.FN`` through ``phalanx.resolve(NAME, accelerator="cpu",
devices=N, timeout=T)`` instead (``--timeout T``, seconds). In the launching process it prints one line,
``PHALANX-RESULT <json>`` (a list: each launch's results) or
``PHALANX-FAILED <json>`` (the WorkerFailedError) and exits 3. In the ranks
(the same script, re-run) it prints nothing of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import rank_fns

from phalanx_core import WorkerFailedError
from phalanx_torch.environments import LocalEnvironment
from phalanx_torch.launchers import MultiprocessingLauncher, SubprocessLauncher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("fn")
    parser.add_argument("--arg", action="append", default=[])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--launcher", default="subprocess", choices=["subprocess", "spawn", "fork"])
    parser.add_argument("--strategy")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--listen-on", default="127.0.0.1")
    options = parser.parse_args()
    fn = getattr(rank_fns, options.fn)
    if options.strategy:
        import phalanx

        strategy = phalanx.resolve(
            options.strategy, accelerator="cpu", devices=options.processes, timeout=options.timeout
        )
        launch = strategy.launch
    elif options.launcher == "subprocess":
        launch = SubprocessLauncher(
            environment=LocalEnvironment(),
            num_processes=options.processes,
            num_nodes=options.nodes,
            max_restarts=options.max_restarts,
            listen_on=options.listen_on,
        ).launch
    else:
        launch = MultiprocessingLauncher(
            environment=LocalEnvironment(), num_processes=options.processes, start_method=options.launcher
        ).launch
    # Several launches: each passes its number, so a result tells whose it is.
    numbered = [[f"launch-{i}"] if options.launches > 1 else [] for i in range(1, options.launches + 1)]
    launching = "TORCHELASTIC_RUN_ID" not in os.environ
    try:
        results = [launch(fn, *options.arg, *extra) for extra in numbered]
    except WorkerFailedError as exc:
        if not launching:
            raise
        failed = {"rank": exc.rank, "exitcode": exc.exitcode, "signal": exc.signal}
        print("PHALANX-FAILED " + json.dumps({**failed, "traceback": exc.traceback, "message": str(exc)}))
        sys.exit(3)
    if launching:
        print("PHALANX-RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
