"""before_threads_join: a part whose threads end only when told still lets
its process exit, by Python's own exit and by exit_process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import sys, threading
    from phalanx_core.launching import before_threads_join, exit_process

    told = threading.Event()
    worker = threading.Thread(target=told.wait)  # not a daemon: Python waits for it
    worker.start()
    before_threads_join(lambda: (print("told", flush=True), told.set()))
    if sys.argv[1] == "exit_process":
        exit_process(3)
    """
)


@pytest.mark.parametrize("way", ["python", "exit_process"])
def test_a_thread_that_ends_when_told_is_told_before_the_exit_waits_for_it(way):
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, way], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout == "told\n", done.stderr
    assert done.returncode == (3 if way == "exit_process" else 0), done.stderr


def test_a_failed_rank_leaving_at_once_runs_nothing():
    program = PROGRAM.replace("exit_process(3)", "exit_process(1, run_atexit=False, join_threads=False)")
    done = subprocess.run(
        [sys.executable, "-c", program, "exit_process"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.stdout, done.returncode) == ("", 1), done.stderr


def test_exit_process_ends_a_thread_pool_left_open_as_pythons_exit_does():
    # concurrent.futures ends a pool's idle workers from threading's exit
    # hooks; a script that leaves a pool open exits under plain Python.
    program = textwrap.dedent(
        """
        import concurrent.futures
        from phalanx_core.launching import exit_process

        pool = concurrent.futures.ThreadPoolExecutor(2)
        print(pool.submit(lambda: "done").result(), flush=True)
        exit_process(3)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.stdout, done.returncode) == ("done\n", 3), done.stderr
