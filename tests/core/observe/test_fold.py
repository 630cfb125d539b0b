"""``EventFold``: events dispatched to ``_on_<Kind>`` handlers, checked against the vocabulary."""

import pytest

from dflash_core.observe import events as ev
from dflash_core.observe.fold import EventFold


class Count(EventFold):
    def __init__(self):
        self.steps, self.errors = [], 0

    def _on_StepMetrics(self, e):
        self.steps.append(e.step)
        return "step"

    def _on_Error(self, e):
        self.errors += 1


class CountMore(Count):
    def _on_Log(self, e):
        return "log"


def _step(i):
    return ev.StepMetrics(step=i, epoch=0, loss=1.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0,
                          samples_per_s=1.0, tau_tf=2.0)


def test_dispatch_to_the_handler_of_the_kind():
    fold = Count()
    assert fold.dispatch(_step(3)) == "step"
    assert fold.dispatch(ev.Log(level="info", source="x", message="m"), default="none") == "none"
    fold.dispatch(ev.Error(error_kind="io", source="x", message="m"))
    assert fold.steps == [3] and fold.errors == 1
    assert fold.handler(ev.HostSample(ram_used=1, ram_total=2, cpu_percent=0.0)) is None


def test_kinds_are_the_handled_ones_inherited_too():
    assert Count.kinds() == {"StepMetrics", "Error"}
    assert CountMore.kinds() == {"StepMetrics", "Error", "Log"}
    assert CountMore().dispatch(ev.Log(level="info", source="x", message="m")) == "log"


def test_a_misspelt_kind_fails_when_the_class_is_defined():
    with pytest.raises(TypeError, match="StepMetric: no such event kind"):
        class Typo(EventFold):  # noqa: F841 - defining it is the test
            def _on_StepMetric(self, e):
                pass
