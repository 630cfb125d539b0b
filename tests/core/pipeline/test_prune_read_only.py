"""Issue 59: `--resume` with checkpoint.keep 1 where the checkpoint to prune is read-only
(another user's files, a read-only snapshot). The run goes on; the checkpoint stays whole under
its name (it was renamed to a hidden .del- folder and half deleted); one warning names it and
what to do; the run's own new checkpoints are written and load."""

import pytest

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import checkpoint_step, list_checkpoints
from dflash_core.checkpoint.layout import CHECKPOINTS, STATE_DIR
from dflash_core.observe.events import Checkpoint, Log, RunEnded
from dflash_core.pipeline.engine import Engine

from ..checkpoint.read_only import read_only  # noqa: F401 - a fixture
from ..engine_fixtures import (  # noqa: F401 - assets, shutdown_started_engines: fixtures
    assets, make_config, run_to_end, shutdown_started_engines,
)


def _cfg(tmp_path, assets, steps, keep):
    target, data = assets
    return make_config(tmp_path, target, data, run__max_steps=steps, checkpoint__every=2,
                       checkpoint__keep=keep, data__eval_prompts=0)


def test_resume_goes_on_past_a_read_only_checkpoint_to_prune(tmp_path, assets, read_only):
    first = Engine(_cfg(tmp_path, assets, 4, keep=0))
    assert run_to_end(first, timeout=120).of(RunEnded)[0].status == "finished"
    first.shutdown()
    cfg = _cfg(tmp_path, assets, 8, keep=1)
    root = cfg.run_dir / CHECKPOINTS
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4"]
    read_only(root / "step-2" / STATE_DIR)

    resumed = Engine(cfg, resume=True)
    rec = run_to_end(resumed, timeout=120)
    resumed.shutdown()
    end = rec.of(RunEnded)[0]
    assert end.status == "finished", end.reason
    said = [e.message for e in rec.of(Log) if "could not delete" in e.message]
    assert len(said) == 1, said  # once, though checkpoints 6 and 8 both tried again
    assert said[0].startswith("checkpoint.keep 1: could not delete step-2 (")
    assert "under its name" in said[0] and "Make it writable" in said[0]
    assert [c.step for c in rec.of(Checkpoint)] == [6, 8]
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-8"]  # none hidden
    assert [checkpoint_step(p) for p in list_checkpoints(cfg.run_dir)] == [2, 8]  # step-2 whole
    assert ckpt.load_checkpoint(root / "step-8").step == 8


@pytest.mark.parametrize("part", [".", "events.jsonl"])
def test_resume_of_a_read_only_run_folder_is_one_config_line(tmp_path, assets, read_only, part):
    """The folder, or its event log, read-only: not an [io] PermissionError naming a temporary
    file: the key and its fix, exit 2 (as a new run's unwritable folder), before the target
    loads."""
    from dflash_core.observe.events import Error
    from dflash_core.pipeline.headless import run_exit_code

    first = Engine(_cfg(tmp_path, assets, 2, keep=0))
    assert run_to_end(first, timeout=120).of(RunEnded)[0].status == "finished"
    first.shutdown()
    cfg = _cfg(tmp_path, assets, 4, keep=0)
    before = sorted(p.name for p in cfg.run_dir.iterdir())
    read_only(cfg.run_dir / part)
    resumed = Engine(cfg, resume=True)
    rec = run_to_end(resumed, timeout=120)
    resumed.shutdown()
    end = rec.of(RunEnded)[0]
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert err.error_kind == "config" and \
        f"run.output_dir: cannot write run folder {cfg.run_dir}: [Errno " in err.message
    assert ("not permitted" in err.message or "denied" in err.message), err.message
    assert "writable" in err.hint
    assert end.status == "failed" and run_exit_code(resumed) == 2
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == before  # nothing left in it
