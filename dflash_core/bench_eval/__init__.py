"""Benchmark evaluation: drafters against their target on named prompt sets, as papers report
them (docs/eval.md; ``dflash-tui eval``).

One module a job:

- prompt_sets.py: JSONL prompt files (OpenAI ``messages``, ``prompt`` or ``turns``);
- rendering.py: the target's chat template, its thinking switch, stop tokens;
- drafters.py: checkpoints and published DFlash / DSpark folders, checked against the target;
- drafting.py: one round's proposals of many prompts in one drafter forward;
- target_batch.py: the target's side (one full forward for a batch, or a cache per prompt);
- sampling.py: temperature and the speculative-sampling acceptance rule, seeded per prompt;
- spec_decode.py: the decoding loop (speculative, or plain without a drafter);
- results.py: results files per (set, decoder), continued when run again;
- summary.py: tau, accepted@k, tokens/s, speedup, the lossless check;
- table.py: the side-by-side table; runner.py: one evaluation from options to report;
- run_sets.py: a training run's own evaluation on named sets (eval.prompt_sets).
"""

from dflash_core.bench_eval.errors import EvalInputError
from dflash_core.bench_eval.runner import EvalOptions, EvalReport, Evaluation, run_eval
from dflash_core.bench_eval.table import set_table

__all__ = ["EvalInputError", "EvalOptions", "EvalReport", "Evaluation", "run_eval",
           "set_table"]
