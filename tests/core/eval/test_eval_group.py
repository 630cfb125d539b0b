"""`dflash-tui eval` with the target as a target group (--gpus-per-copy 2, gloo on the CPU): the
plain decoding and the drafter's tau, rounds and tokens equal the same evaluation of the target
whole; the drafter's output is the group's own plain decoding (the lossless check passes); the
group's split is said in the results' settings; what cannot be asked is refused in one line
naming the flag, before anything loads."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import psutil

import pytest

from dflash_core.eval import EvalInputError, EvalOptions, Evaluation, run_eval
from tests.core.eval.conftest import chat_target, save_dflash, write_jsonl
from tests.core.pipeline.test_headless import ROOT


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("eval-group")
    folder = chat_target(root / "target")
    hf = AutoConfig.from_pretrained(folder)
    drafter = save_dflash(root / "drafter", hf, 0, [0, 2], block=4, mask=hf.vocab_size - 1)
    prompts = write_jsonl(root / "a.jsonl", [{"prompt": "What is two plus two?"},
                                             {"prompt": "Hello!"}, {"prompt": "Name a colour."}])
    return folder, drafter, prompts


def _opts(chat, out, **kw) -> EvalOptions:
    folder, drafter, prompts = chat
    return EvalOptions(str(folder), [str(drafter)], [f"a={prompts}"], max_new_tokens=12,
                       batch=2, out=str(out), device="cpu", **kw)


def _lines(out, name: str) -> list[dict]:
    rows = [json.loads(x) for x in (out / "a" / name).read_text().splitlines()]
    return sorted((r for r in rows if r.get("kind") == "prompt"), key=lambda r: r["index"])


@pytest.mark.parametrize("cache", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["full", "cache"])
def test_eval_through_a_group_is_the_target_whole_s(chat, tmp_path, cache):
    whole = run_eval(_opts(chat, tmp_path / "whole", cache=cache), lambda m: None)
    said: list[str] = []
    got = run_eval(_opts(chat, tmp_path / "group", cache=cache, gpus_per_copy=2), said.append)
    assert any("as a target group of 2 ranks on cpu, cpu, sharded (fsdp 2)" in m
               for m in said), said
    assert not got.mismatches and not whole.mismatches  # lossless against its own plain
    (g,), (w,) = got.sets, whole.sets
    assert g.drafters["drafter"].tau == pytest.approx(w.drafters["drafter"].tau, abs=1e-9)
    assert g.drafters["drafter"].rounds == w.drafters["drafter"].rounds > 0
    for name in ("plain.jsonl", "drafter-drafter.jsonl"):
        a, b = _lines(tmp_path / "group", name), _lines(tmp_path / "whole", name)
        assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
        assert [r.get("acceptance") for r in a] == [r.get("acceptance") for r in b]
    summary = json.loads((tmp_path / "group" / "results.json").read_text())
    assert summary["settings"]["target_group"] == "sharded (fsdp 2)"


@pytest.mark.parametrize("kw, said, hint", [
    (dict(gpus_per_copy=2, target_gpus="0,1"), "--target-gpus names GPUs: on the CPU",
     "leave --target-gpus out"),
    (dict(target_gpus="0,1"), "--target-gpus names the GPUs of a target group",
     "--gpus-per-copy K"),
    (dict(gpus_per_copy=3, parallel="shared"),
     "--gpus-per-copy 3: tensor parallel over 3 GPUs: the target's 4 attention heads do not "
     "divide by 3", "pass --gpus-per-copy a divisor of 4, or pass --parallel sharded"),
    (dict(gpus_per_copy=2, engine="vllm"), "--engine vllm with --gpus-per-copy 2",
     "leave --engine out"),
])
def test_what_cannot_be_asked_is_refused_before_anything_loads(chat, tmp_path, kw, said, hint):
    with pytest.raises(EvalInputError) as exc:
        Evaluation(_opts(chat, tmp_path / "out", **kw), lambda m: None)
    assert said in str(exc.value) and hint in exc.value.hint, (str(exc.value), exc.value.hint)
    assert not (tmp_path / "out").exists()


def test_a_refusal_is_one_line_and_exit_2(chat, tmp_path):
    folder, drafter, prompts = chat
    res = subprocess.run([sys.executable, "-m", "dflash_tui.cli", "eval", "--target",
                          str(folder), "--drafter", str(drafter), "--prompts", f"a={prompts}",
                          "--device", "cpu", "--gpus-per-copy", "3", "--parallel", "shared",
                          "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: --gpus-per-copy 3: tensor parallel")
    assert lines[1].startswith("hint: pass --gpus-per-copy a divisor of 4")


def test_a_rank_killed_during_the_evaluation_is_named_exit_1(chat, tmp_path):
    folder, drafter, prompts = chat
    proc = subprocess.Popen([sys.executable, "-m", "dflash_tui.cli", "eval", "--target",
                             str(folder), "--drafter", str(drafter), "--prompts",
                             f"a={prompts}", "--device", "cpu", "--gpus-per-copy", "2",
                             "--out", str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids, said = [], []
    for line in proc.stderr:
        said.append(line)
        found = re.search(r"pids \[([\d, ]+)\]", line)
        if found:
            pids = [int(p) for p in found.group(1).split(", ")]
        if "ranks loaded" in line:
            os.kill(pids[1], signal.SIGKILL)
    rc = proc.wait(120)
    err = "".join(said)
    assert rc == 1, err
    assert re.search(r"error \[oom\]: target group 0 rank 1 \(cpu:0\.1, pid \d+\) killed by "
                     r"SIGKILL", err), err
    assert "the same command again" in err and "every whole batch is kept" in err
    assert "Traceback" not in err
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
