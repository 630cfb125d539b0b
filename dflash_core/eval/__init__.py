"""Evaluation, named after the verb (``dflash-tui eval``, docs/eval.md): drafters against their
target on named prompt sets, as papers report them; the run's own evaluation's decoding and
measures; ``check``'s decoding. ONE speculative decoding loop (spec_decode.py) serves them all.

The rules of acceptance (its measures, their gaps and words) are ``dflash_core/acceptance.py``,
below every reader: the sinks and the screen read them without this package.

One module a job:

- target_decoding.py: the target's side (one prompt's state, full forwards or the cache; a
  batch: one full forward for all, or a state per prompt);
- evaluate.py: one prompt's decoding and the held-out prompts' exact tau (the loop, a batch of
  one each), the teacher-forced tau, the evaluation's attention;
- prompt_sets.py: JSONL prompt files (OpenAI ``messages``, ``prompt`` or ``turns``);
- rendering.py: the target's chat template, its thinking switch, stop tokens;
- drafters.py: checkpoints and published DFlash / DSpark folders, checked against the target;
- drafting.py: one round's proposals of many prompts (each family's ``draft_batch``);
- sampling.py: temperature and the speculative-sampling acceptance rule, seeded per prompt;
- spec_decode.py: THE decoding loop (speculative, or plain without a drafter);
- results.py: results files per (set, decoder), continued when run again;
- summary.py: tau, accepted@k, tokens/s, speedup, the lossless check;
- table.py: the side-by-side table; options.py: what an evaluation is asked; runner.py: one
  evaluation from options to report; report.py: what it found, set by set, and its results.json;
- run_sets.py: a training run's own evaluation on named sets (eval.prompt_sets).
"""

import importlib

# Loaded on first use, so that a reader of one module here (the run's evaluation reads
# evaluate.py) does not load the verb's runner with it.
_EXPORTS = {"EvalInputError": "errors", "EvalOptions": "options", "EvalReport": "report",
            "Evaluation": "runner", "run_eval": "runner", "set_table": "table"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
