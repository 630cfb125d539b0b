"""The rules of acceptance: each gap raises its own finding and only that one; the words used."""

import pytest

from dflash_core.config import EvalConfig
from dflash_core.acceptance import (
    MEASURES,
    REGENERATE_COMMAND,
    accepted_at,
    findings,
    summary_line,
)
from dflash_core.observe.events import EvalResult, from_dict

CFG = EvalConfig()


def kinds(**kw):
    args = dict(step=100, exact=3.0, target=3.1, heldout=3.1, train=3.3, agreement=0.98)
    args.update(kw)
    return [f.kind for f in findings(eval_cfg=CFG, **args)]


def test_a_healthy_evaluation_raises_nothing():
    assert kinds() == []


def test_each_gap_raises_its_own_finding_only():
    assert kinds(target=3.0 + CFG.tau_gap_warn + 0.1, heldout=3.0 + CFG.tau_gap_warn + 0.1,
                 train=3.0 + CFG.tau_gap_warn + 0.1) == ["mismatch"]
    assert kinds(heldout=3.1 - CFG.data_gap_warn - 0.1, train=3.1 - CFG.data_gap_warn - 0.1,
                 agreement=None) == ["data"]
    assert kinds(agreement=CFG.agreement_warn - 0.01) == ["data"]
    assert kinds(train=3.1 + CFG.overfit_gap + 0.1) == ["overfit"]


def test_the_thresholds_are_strict_and_one_sided():
    assert kinds(target=3.0 + CFG.tau_gap_warn) == []  # at the threshold: not past it
    assert kinds(exact=4.5) == []  # exact above teacher-forced is no leak
    assert kinds(train=2.0) == []  # training below held-out is no over-fitting
    assert kinds(heldout=3.1 + CFG.data_gap_warn + 0.1, train=3.1 + CFG.data_gap_warn + 0.1,
                 agreement=None) == ["data"]  # either side: not the target's


def test_a_measure_not_taken_takes_part_in_no_rule():
    assert kinds(target=None, heldout=None, train=None, agreement=None, exact=0.1) == []
    assert kinds(target=-1.0, heldout=-1.0, train=-1.0, agreement=-1.0) == []


def test_the_messages_name_the_cause_the_key_and_the_fix():
    (mismatch,) = findings(100, 1.2, 4.0, 4.0, 4.1, 0.99, CFG)
    assert mismatch.level == "warning" and "training and decoding disagree" in mismatch.message
    assert "eval.tau_gap_warn" in mismatch.message and "drafter.mask_token_id" in mismatch.message
    (data,) = findings(100, 3.0, 3.1, 1.5, 1.6, 0.3, CFG)
    assert data.level == "warning" and "not the target's own text" in data.message
    assert "30% of the trained labels" in data.message and REGENERATE_COMMAND in data.message
    (over,) = findings(100, 3.0, 3.1, 3.1, 6.0, 0.99, CFG)
    assert over.level == "info" and "over-fitting" in over.message
    assert "optim.epochs" in over.message


def test_the_data_finding_agrees_with_the_measured_agreement():
    gap = dict(heldout=4.25, train=4.3, target=2.63)  # the figures: a gap of 1.6
    # labels the target's own (98%): the gap alone says nothing of the data's author
    assert kinds(**gap, agreement=0.98) == []
    # labels not the target's: one warning, the agreement first, the gap beside it, the fix
    (low,) = findings(eval_cfg=CFG, step=100, exact=2.6, agreement=0.3, **gap)
    assert low.level == "warning" and "not the target's own text" in low.message
    assert low.message.index("30% of the trained labels") < low.message.index("4.25")
    assert REGENERATE_COMMAND in low.message
    # not measured: a suspicion, with how to measure it before regenerating
    (maybe,) = findings(eval_cfg=CFG, step=100, exact=2.6, agreement=None, **gap)
    assert "may not be the target's own text" in maybe.message
    assert "data inspect DATA --target TARGET" in maybe.message
    assert "eval.agreement_samples" in maybe.message


def test_accepted_at_each_block_position():
    # 6 rounds: 1 accepted 0 drafted tokens, 2 accepted 1, 3 accepted 2
    assert accepted_at([1, 2, 3]) == pytest.approx([5 / 6, 3 / 6])
    assert accepted_at([]) == [] and accepted_at([0, 0]) == []


def test_the_summary_shows_every_measure_in_order_and_old_events_too():
    e = EvalResult(step=5, tau=2.5, acceptance=[1, 1], prompts=2, tau_tf_target=2.75,
                   tau_tf_heldout=2.5, tau_tf_train=3.0, agreement=0.9, agreement_positions=9)
    line = summary_line(e)
    assert line == ("tau exact 2.50 | tf target 2.75 | tf held-out 2.50 | tf train 3.00 | "
                    "labels = target 90% | accepted@k 50%")
    assert [m.label for m in MEASURES] == [p.rsplit(" ", 1)[0] for p in line.split(" | ")[:4]]
    old = from_dict({"event": "EvalResult", "ts": 1.0, "step": 5, "tau": 2.5,
                                "acceptance": [1, 1], "prompts": 2})
    assert summary_line(old) == ("tau exact 2.50 | tf target - | tf held-out - | tf train - | "
                                 "accepted@k 50%")


# -- the data finding names the likely cause from where the responses came from -------------------
# (data/provenance.py: the prepared data's manifest; issue 48 item 9)

def provenance(rows=12, regenerated=12, text=12, ids=0, **regeneration):
    rec = {"endpoints": ["http://gpu1:8000"], "temperature": 0.0, "round_trip": None}
    rec.update(regeneration)
    return {"rows": rows, "regenerated_rows": regenerated, "answers_as_text": text,
            "answers_as_token_ids": ids, "models": {"target": regenerated},
            "regeneration": rec}


def data_message(p, agreement=0.77):
    (f,) = findings(100, 3.0, 3.1, 3.1, 3.2, agreement, CFG, provenance=p)
    assert f.kind == "data" and f.level == "warning"
    return f.message


def test_answers_regenerated_as_text_name_the_round_trip_not_regenerating_again():
    rt = {"agree": 7, "positions": 9, "first_difference": [0, "if", "   "], "sample": "c0"}
    msg = data_message(provenance(round_trip=rt))
    assert "77% of the trained labels" in msg
    assert ("regenerated by 'target' through http://gpu1:8000 already, but 12 of 12 answers "
            "came back as text only and prepare re-tokenized them") in msg
    assert "text round trip" in msg and "leading space" in msg
    assert ("regenerate's probe measured 7 of 9 returned tokens the target's own on sample c0 "
            "(at answer token 0 the text gives 'if', the target writes '   ')") in msg
    assert "regenerating through the same server changes nothing" in msg
    assert "return_token_ids" in msg and "vLLM" in msg
    assert "dflash-tui data inspect DATA --target TARGET" in msg
    # not the advice already followed
    assert "written by another model" not in msg and REGENERATE_COMMAND not in msg


def test_an_agreement_far_below_what_a_round_trip_does_names_the_server_too():
    msg = data_message(provenance(), agreement=0.09)
    assert "came back as text only" in msg
    assert "a round trip changes a few tokens per answer, not 91% of them" in msg
    assert "other weights under that name" in msg
    assert "not 23% of them" not in data_message(provenance())  # 0.77: the round trip's size


def test_answers_with_token_ids_point_elsewhere_than_the_round_trip():
    msg = data_message(provenance(text=0, ids=12))
    assert "with the server's token ids, so no text round trip changed them" in msg
    assert "other weights under that name" in msg and "chat template" in msg
    assert REGENERATE_COMMAND not in msg


def test_sampled_answers_say_so():
    msg = data_message(provenance(temperature=0.7))
    assert "sampled at temperature 0.7" in msg and "--temperature 0" in msg


def test_rows_not_all_regenerated_are_the_cause_named_first():
    msg = data_message(provenance(rows=40, regenerated=12))
    assert "Only 12 of the 40 rows were regenerated by 'target'" in msg
    assert REGENERATE_COMMAND in msg and "round trip" not in msg


def test_data_without_provenance_keeps_the_words_it_had():
    for p in (None, {}, {"rows": 5, "regenerated_rows": 0}, {"regenerated_rows": "x"}):
        msg = data_message(p, agreement=0.3)
        assert ("The responses were written by another model (or with another chat template): "
                f"regenerate them with the target ({REGENERATE_COMMAND})") in msg


def test_the_suspicion_names_the_round_trip_too():
    gap = dict(heldout=4.25, train=4.3, target=2.63)
    (maybe,) = findings(eval_cfg=CFG, step=100, exact=2.6, agreement=None, **gap,
                        provenance=provenance())
    assert "may not be the target's own text" in maybe.message
    assert "if it is low, the likely cause: the responses were regenerated" in maybe.message
    assert "text round trip" in maybe.message and REGENERATE_COMMAND not in maybe.message
