"""Each fault planted in the demo raises its own finding at the first evaluation, and only that
one; the healthy demo raises none (three seeds). These train the demo for minutes on CPU: the
fast paths of the same rules are tests/core/eval/test_acceptance.py (the rules),
test_evaluate.py (the teacher-forced pass is decoding's) and test_agreement.py."""

import pytest

from .acceptance_demo import run_demo

pytestmark = pytest.mark.slow

# A smaller evaluation than the demo's: fewer prompts, the same text length.
SMALL = {"data__eval_prompts": 8}


def first_findings(r):
    assert r.ended.status == "finished" and r.evals, r.ended
    return r.evals[0].findings


def shown(r, what: str):
    """``r``, its measures printed (pytest -s): what the thresholds were set from."""
    for e in r.evals:
        print(f"\n{what} step {e.step}: (a) {e.tau:.2f} (b) {e.tau_tf_target:.2f} "
              f"(b all) {e.tau_tf_target_all:.2f} (c) {e.tau_tf_heldout:.2f} "
              f"(d) {e.tau_tf_train:.2f} agreement {e.agreement:.2f} "
              f"findings {e.findings or '-'}; {r.steps} steps in {r.seconds:.0f} s")
    return r


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_healthy_demo_raises_nothing(tmp_path, demo_data, seed):
    r = shown(run_demo(tmp_path, demo_data, seed=seed, steps=30, every=30, **SMALL),
              f"healthy s{seed}")
    assert r.kinds() == set(), [f.message for f in r.findings]
    e = r.evals[0]
    assert abs(e.tau_tf_target - e.tau) < 0.05  # the same blocks of the same text
    assert e.agreement == pytest.approx(1.0, abs=0.02)  # the demo's data is the target's


def test_a_leak_in_the_training_attention_is_the_mismatch_alarm(tmp_path, demo_data):
    r = shown(run_demo(tmp_path, demo_data, fault="leak", steps=60, every=60, **SMALL), "leak")
    assert first_findings(r) == ["mismatch"]
    # the periodic evaluation of step 60 and the end-of-run one (the same step) say the same
    log = r.findings[0]
    assert log.message.startswith("step 60") and log.level == "warning"
    assert "training and decoding disagree" in log.message


def test_responses_not_written_by_the_target_are_the_data_finding(tmp_path, demo_data):
    r = shown(run_demo(tmp_path, demo_data, fault="foreign", steps=30, every=30, **SMALL),
              "foreign")
    assert first_findings(r) == ["data"]
    assert r.evals[0].agreement < 0.8
    assert "data regenerate" in r.findings[0].message


def test_a_handful_of_samples_for_many_epochs_is_over_fitting(tmp_path, demo_data):
    r = shown(run_demo(tmp_path, demo_data, fault="overfit", steps=160, every=160, **SMALL),
              "overfit")
    assert first_findings(r) == ["overfit"]
    assert r.findings[0].level == "info"
