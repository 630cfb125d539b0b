"""Tau by context length in `dflash-tui eval` (context_buckets.py): every set's summary in
results.json carries it, per decoder, in the buckets of the target's window, counted from the
results files' prompt lengths and acceptance; the table shows a row per bucket only when a
drafter has rounds in more than one."""

import dataclasses
import json

import pytest

from dflash_core.context_buckets import Buckets, by_context, round_positions
from dflash_core.eval import EvalOptions, Evaluation
from dflash_core.eval.table import set_table

NEW = 12
KEYS = {"bucket", "from", "to", "rounds", "accepted", "tau"}


@pytest.fixture(scope="module")
def measured(demo_eval, tmp_path_factory, module_thread):
    out = tmp_path_factory.mktemp("out")
    opts = EvalOptions(target=str(demo_eval["target"]), drafters=[str(demo_eval["drafters"][0])],
                       prompts=[f"plain={demo_eval['sets']['plain']}"], max_new_tokens=NEW,
                       batch=3, limit=3, out=str(out), device="cpu")
    ev = Evaluation(opts, lambda m: None)
    return ev, ev.run(), out


def test_results_json_holds_tau_by_context_per_decoder(measured):
    ev, rep, out = measured
    saved = json.loads((out / "results.json").read_text())["sets"]["plain"]
    (label,) = saved["drafters"]
    lines = [json.loads(x) for x in (out / "plain" / f"drafter-{label}.jsonl").read_text()
             .splitlines()[1:]]
    prompts = [x for x in lines if x["kind"] == "prompt"]
    for d in (saved["plain"], saved["drafters"][label]):
        ctx = d["context"]
        # the demo target's window, 1024 positions: its buckets
        assert [r["bucket"] for r in ctx] == ["0-128", "128-512", "512-1k"]
        assert all(set(r) == KEYS for r in ctx)
        assert sum(r["rounds"] for r in ctx) == d["rounds"]
        assert sum(r["accepted"] for r in ctx) == sum(k * n for k, n in
                                                      enumerate(d["acceptance"]))
    want = by_context(Buckets.of(1024), [(round_positions(x["prompt_tokens"], x["acceptance"]),
                                          x["acceptance"]) for x in prompts])
    assert saved["drafters"][label]["context"] == want


def test_the_table_shows_the_buckets_only_when_a_drafter_has_rounds_in_two(measured):
    ev, rep, _ = measured
    s = rep.sets[0]
    (label,) = s.drafters
    assert not any(line.startswith("tau 0-") for line in
                   set_table(s.name, s.prompts, s.plain, s.drafters, rep.per_round, True)
                   .splitlines())  # one bucket: the tau row says it
    two = by_context(Buckets.of(1024), [([100, 101], [2, 0]), ([300], [3])])
    drafted = {label: dataclasses.replace(s.drafters[label], context=two)}
    rows = set_table(s.name, s.prompts, s.plain, drafted, rep.per_round, True).splitlines()
    got = {r.split()[1]: r.split()[2:] for r in rows if r.startswith("tau ") and "-" in
           r.split()[1]}
    assert got == {"0-128": ["-", "2.00", "(2)"], "128-512": ["-", "4.00", "(1)"]}
