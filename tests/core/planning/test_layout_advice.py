"""Which side bounds a run and the split that balances the node, from rates measured in it."""

import time

from dflash_core.observe.events import Log, StepMetrics, TargetMetrics
from dflash_core.planning.layout_advice import LayoutAdvisor
from dflash_core.models.training.replica import DrafterReplica

from ..engine_fixtures import assets, make_config, run_config  # noqa: F401 - assets is a fixture


def step(n, samples_per_s, wait, tokens_per_s):
    return StepMetrics(step=n, epoch=0, loss=1.0, lr=1e-4, grad_norm=1.0,
                       tokens_per_s=tokens_per_s, samples_per_s=samples_per_s, tau_tf=2.0,
                       drafter_wait_frac=wait)


def test_a_drafter_bound_run_on_eight_gpus():
    # 1 target + 1 drafter on a node of 8. The target works 20% of the time at 45k tokens/s
    # (blocked 80%), 1000 tokens a sample: 45 samples/s while working. The drafter trains
    # 2.5 samples/s and never waits. 45 / 2.5 = 18 drafters per target; of 8 GPUs, 1 + 7.
    out = []
    adv = LayoutAdvisor(out.append, targets=1, drafters=1, gpus=8, at_step=10)
    adv(TargetMetrics(worker="target-0", device="cuda:0", batches=5, tokens_per_s=9000.0,
                      blocked_frac=0.8, starved_frac=0.0))
    for n in range(1, 11):
        adv(step(n, samples_per_s=2.5, wait=0.0, tokens_per_s=2500.0))
    (log,) = [e for e in out if isinstance(e, Log)]
    assert "one target extracts 45.00 samples/s, one drafter trains 2.50" in log.message
    assert "1 target feeds 18.0 drafters; the drafters bound this run" in log.message
    assert "for 8 GPUs: 1 target(s) + 7 drafter(s), ~17.50 samples/s" in log.message
    adv(step(11, 2.5, 0.0, 2500.0))
    assert len([e for e in out if isinstance(e, Log)]) == 1  # said once


def test_a_target_bound_run_suggests_more_targets():
    out = []
    adv = LayoutAdvisor(out.append, targets=1, drafters=7, gpus=8, at_step=5)
    # the target never waits: 8 samples/s; the drafters wait 90% of the time: 0.2 samples/s
    # each over the step, 2.0 while working
    adv(TargetMetrics(worker="target-0", device="cuda:0", batches=5, tokens_per_s=8000.0,
                      blocked_frac=0.0, starved_frac=0.0))
    for n in range(1, 6):
        adv(step(n, samples_per_s=1.4, wait=0.9, tokens_per_s=1400.0))
    (log,) = [e for e in out if isinstance(e, Log)]
    assert "the targets bound this run" in log.message
    assert "for 8 GPUs: 2 target(s) + 6 drafter(s)" in log.message


def test_a_target_report_caught_compiling_does_not_set_the_rate():
    # Batches of new shapes compile kernels: an occasional report of the target runs at a third
    # of its rate. The median of its recent reports is the rate; the mean would be 7,000.
    out = []
    adv = LayoutAdvisor(out.append, targets=1, drafters=1, gpus=2, at_step=5)
    for tokens in (9000.0, 3000.0, 9000.0, 9000.0, 3000.0):
        adv(TargetMetrics(worker="target-0", device="cuda:0", batches=1, tokens_per_s=tokens,
                          blocked_frac=0.0, starved_frac=0.0))
    for n in range(1, 6):
        adv(step(n, samples_per_s=2.0, wait=0.0, tokens_per_s=2000.0))
    (log,) = [e for e in out if isinstance(e, Log)]
    assert "one target extracts 9.00 samples/s" in log.message


def test_an_engine_run_says_it(tmp_path, assets, monkeypatch):
    import dflash_core.planning.layout_advice as mod

    monkeypatch.setattr(mod, "ADVISE_AT_STEP", 30)
    original = DrafterReplica.accumulate

    def slower(self, *args, **kwargs):  # the tiny run would end before a target's first report
        time.sleep(0.05)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", slower)
    target, data = assets
    end, rec = run_config(make_config(tmp_path, target, data, run__max_steps=40,
                                      optim__epochs=20, data__eval_prompts=0,
                                      checkpoint__every=0))
    assert end.status == "finished"
    (log,) = [e for e in rec.of(Log) if e.source == "layout"]
    assert "1 target feeds" in log.message and "bound this run" in log.message
