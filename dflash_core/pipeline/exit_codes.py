"""What a dflash-tui process's exit code says about its run, the same for the dashboard and
headless: 0 finished, 1 failed, 2 refused on its input (a config error: a bad value or file, a
run folder that holds an earlier run, a checkpoint that does not match; a data error: training
data that cannot be used; also a bad command line, said before any run), 130 aborted (an operator's abort or quit, SIGINT / SIGTERM)."""

from __future__ import annotations

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_INPUT = 2
EXIT_ABORTED = 130
INPUT_KINDS = ("config", "data")  # error kinds that are the input's fault, not the run's
_BY_STATUS = {"finished": EXIT_FINISHED, "failed": EXIT_FAILED, "aborted": EXIT_ABORTED}


def exit_code(status: str, failure_kind: str = "") -> int:
    """The code for a run that ended in ``status`` (a terminal state); ``failure_kind``: the
    error_kind of the error that failed it. A run that did not reach an end (a stuck thread
    left behind) is 1."""
    if status == "failed" and failure_kind in INPUT_KINDS:
        return EXIT_INPUT
    return _BY_STATUS.get(status, EXIT_FAILED)
