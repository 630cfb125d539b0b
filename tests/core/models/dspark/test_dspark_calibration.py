"""Calibration of the confidence head and the tau an adaptive verifier would get, from recorded
(confidences, accepted) rounds."""

import numpy as np
import pytest

from dflash_core.models.dspark.calibration import calibrate, ece


def test_ece_by_hand():
    # bin [0.2, 0.3): conf 0.25 x2, outcomes 1, 0 -> |0.25 - 0.5| = 0.25, weight 2/4
    # bin [0.9, 1.0]: conf 0.95, 1.0, outcomes 1, 1 -> |0.975 - 1| = 0.025, weight 2/4
    assert ece([0.25, 0.25, 0.95, 1.0], [1, 0, 1, 1]) == pytest.approx(0.5 * 0.25 + 0.5 * 0.025)
    assert ece([], []) == 0.0
    assert ece([0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7], [1] * 7 + [0] * 3) == \
        pytest.approx(0.0)


def test_per_slot_acceptance_is_conditional_on_reaching_the_slot():
    conf = [[0.9, 0.5, 0.2], [0.8, 0.6, 0.1], [0.7, 0.4, 0.3], [0.6]]
    accepted = [3, 1, 0, 1]
    cal = calibrate(conf, accepted, budgets=[])
    assert cal.rounds == 4
    # slot 0: every round reaches it; accepted in rounds 0, 1, 3
    assert cal.reached[0] == 4 and cal.observed[0] == pytest.approx(3 / 4)
    assert cal.expected[0] == pytest.approx((0.9 + 0.8 + 0.7 + 0.6) / 4)
    # slot 1: reached by rounds 0, 1 (round 3 drafted one token only); accepted by round 0
    assert cal.reached[1] == 2 and cal.observed[1] == pytest.approx(1 / 2)
    assert cal.expected[1] == pytest.approx((0.5 + 0.6) / 2)
    # slot 2: reached by round 0 only, accepted
    assert cal.reached[2] == 1 and cal.observed[2] == 1.0 and cal.expected[2] == 0.2
    assert cal.ece_slot[2] == pytest.approx(0.8)
    # survival of slot 1 over the rounds that drafted it: 0.45, 0.48, 0.28; got past: 1 of 3
    assert cal.survival_expected[1] == pytest.approx((0.45 + 0.48 + 0.28) / 3)
    assert cal.survival_observed[1] == pytest.approx(1 / 3)
    assert cal.tau == pytest.approx((4 + 2 + 1 + 2) / 4)


def test_budgets_fixed_and_adaptive_by_hand():
    # two rounds of 4 drafts; round 0 confident and fully accepted, round 1 doubtful, 0 accepted
    conf = [[0.99, 0.99, 0.99, 0.99], [0.3, 0.3, 0.3, 0.3]]
    cal = calibrate(conf, [4, 0], budgets=[2, 4])
    two, four = cal.budgets
    assert (two.drafts, four.drafts) == (2, 4)
    # fixed 2: round 0 gains 3, round 1 gains 1
    assert two.fixed == pytest.approx((3 + 1) / 2)
    # adaptive 2: 4 verifications go to the confident round: it gains 5, the other 1
    assert two.adaptive == pytest.approx((5 + 1) / 2)
    # at the full budget both verify everything: exact tau
    assert four.fixed == four.adaptive == cal.tau == pytest.approx((5 + 1) / 2)


def test_default_budgets_are_2_4_and_the_block():
    rng = np.random.default_rng(0)
    B, R = 7, 200
    conf = rng.uniform(0.05, 0.95, size=(R, B))
    # acceptance drawn from the confidences: a calibrated head
    passed = rng.uniform(size=(R, B)) < conf
    accepted = np.where(passed.all(1), B, np.argmin(passed, axis=1))
    cal = calibrate(conf.tolist(), accepted.tolist())
    assert [b.drafts for b in cal.budgets] == [2, 4, B]
    assert cal.budgets[-1].fixed == cal.budgets[-1].adaptive == pytest.approx(cal.tau)
    for b in cal.budgets[:-1]:
        # an informative confidence puts the budget where it pays: never below the first k
        assert b.adaptive >= b.fixed - 1e-9
        assert b.fixed <= cal.tau
    assert cal.ece < 0.08  # calibrated by construction, up to sampling noise
    # an over-confident head shows: same outcomes, every confidence raised
    over = calibrate(np.clip(conf + 0.3, 0, 1).tolist(), accepted.tolist())
    assert over.ece > cal.ece + 0.15
    assert all(e > o for e, o in zip(over.expected, over.observed) if e)


def test_bad_recordings_are_refused():
    with pytest.raises(ValueError, match="rounds of confidences"):
        calibrate([[0.5]], [0, 1])
    with pytest.raises(ValueError, match="larger than the round's drafts"):
        calibrate([[0.5]], [2])
    assert calibrate([], []).rounds == 0


def test_the_words_every_view_uses():
    from dflash_core import acceptance

    cal = calibrate([[0.99, 0.99, 0.99, 0.99], [0.3, 0.3, 0.3, 0.3]], [4, 0], budgets=[2, 4])
    line = acceptance.calibration_line(cal)
    assert line.startswith("confidence@k 64%/50% 99%/100% 99%/100% 99%/100% | ECE ")
    assert "tau@2 2.00/3.00 | tau@4 3.00/3.00" in line
    rows = acceptance.calibration_rows(cal)
    assert [r[0] for r in rows] == ["confidence@k", "ECE", "tau@2", "tau@4"]
    w = acceptance.calibration_wandb(cal)
    assert w["eval/tau_budget/2/adaptive"] == 3.0 and w["eval/confidence_at/0"] == \
        pytest.approx(0.645)
    assert acceptance.calibration_line(calibrate([], [])) == ""
