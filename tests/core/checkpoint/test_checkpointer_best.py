"""checkpoints/best records the prompt set its exact tau is on (eval.best_set), and a resume that
changed eval.best_set chooses the best again from the new set's tau instead of comparing taus
of different prompts."""

import json

import torch

from dflash_core.config import CheckpointConfig
from dflash_core.observe.events import Checkpoint, Log
from dflash_core.checkpoint.folders import mark_best, read_best
from dflash_core.checkpoint.layout import CHECKPOINTS
from dflash_core.checkpoint.checkpointer import Checkpointer


def checkpointer(run_dir, best_set: str, seen: list) -> Checkpointer:
    return Checkpointer(CheckpointConfig(), run_dir, seen.append, replicas=[],
                        state=lambda rep: {}, served_dtype=torch.bfloat16, optimizer="adamw",
                        best_set=best_set)


def marked(run_dir, step: int, tau: float, prompt_set: str):
    folder = run_dir / CHECKPOINTS / f"step-{step}"
    folder.mkdir(parents=True)
    mark_best(run_dir, folder, step, tau, prompt_set)
    return folder


def test_the_marker_and_the_event_name_the_set(tmp_path):
    seen: list = []
    ck = checkpointer(tmp_path, "gsm8k", seen)
    folder = marked(tmp_path, 2, 1.5, "gsm8k")
    ck.saved_step, ck.saved_path = 4, folder.with_name("step-4")
    ck.saved_path.mkdir()
    ck.keep_best(4, 2.5)
    assert read_best(tmp_path) == {"step": 4, "path": "step-4", "tau": 2.5, "prompt_set": "gsm8k"}
    (best,) = [e for e in seen if isinstance(e, Checkpoint)]
    assert (best.reason, best.step, best.tau, best.prompt_set) == ("best", 4, 2.5, "gsm8k")
    assert not [e for e in seen if isinstance(e, Log)]


def test_a_lower_tau_on_the_same_set_keeps_the_best(tmp_path):
    seen: list = []
    ck = checkpointer(tmp_path, "", seen)
    marked(tmp_path, 2, 3.0, "")
    ck.keep_best(4, 2.0)
    assert read_best(tmp_path)["step"] == 2 and ck.best_tau == 3.0
    assert seen == []


def test_a_resume_with_another_best_set_chooses_the_best_again(tmp_path):
    # the held-out tau (3.0) was higher than the new set's will ever be: compared, no checkpoint
    # of this attempt would ever become the best
    seen: list = []
    marked(tmp_path, 2, 3.0, "")
    ck = checkpointer(tmp_path, "gsm8k", seen)
    ck.saved_step, ck.saved_path = 4, tmp_path / CHECKPOINTS / "step-4"
    ck.saved_path.mkdir()
    ck.keep_best(4, 2.0)
    (warn,) = [e for e in seen if isinstance(e, Log)]
    assert warn.level == "warning"
    assert "the held-out prompts" in warn.message and "prompt set gsm8k" in warn.message
    assert read_best(tmp_path) == {"step": 4, "path": "step-4", "tau": 2.0, "prompt_set": "gsm8k"}


def test_a_marker_written_before_sets_were_recorded_is_the_held_out_one(tmp_path):
    (tmp_path / CHECKPOINTS / "step-2").mkdir(parents=True)
    (tmp_path / CHECKPOINTS / "best").write_text(json.dumps(
        {"step": 2, "path": "step-2", "tau": 3.0}))
    seen: list = []
    ck = checkpointer(tmp_path, "", seen)
    ck.keep_best(4, 2.0)
    assert ck.best_tau == 3.0 and seen == []
