"""Writer-process entry points for tests. A spawned writer imports the module its entry point is
in: this small one, not a test module with its fixtures and their imports."""

import time

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.writer_loop import writer_main

STUCK_STEP = 4


def writer_stuck_at_step_4(index, jobs, results, progress):
    """A writer process that writes the first file of step 4's checkpoint, then hangs there
    until it is killed; every other checkpoint it writes as usual."""
    real = ckpt.write_plans

    def write_plans(folder, files, tensors, progress=None, cancelled=None):
        if folder.name.startswith(f".tmp-step-{STUCK_STEP}-"):
            real(folder, files[:1], tensors, progress, cancelled)
            time.sleep(300)
        return real(folder, files, tensors, progress, cancelled)

    ckpt.write_plans = write_plans
    writer_main(index, jobs, results, progress)
