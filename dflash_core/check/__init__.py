"""The train-to-serve check (``dflash-tui check``; docs/check.md): before a long run, train the
configured drafter on a few samples until it has memorised them, decode their prompts exactly, and
require near-full blocks accepted.

Why it proves something: the samples' responses are written here by the target itself (greedy), so
exact decoding of their prompts verifies the very text the drafter memorised; a drafter that
predicts its training text perfectly must then be accepted almost fully. If it is not, training
and serving disagree (features, mask token, labels, attention), and the evidence gathered on the
way says which.

- ``samples``: prompts from the user's data and the target's own greedy responses;
- ``memorise``: the engine's replicas and optimizer step on those samples, to a step cap;
- ``decode``: exact decoding through this engine's drafter and through the public reference
  implementation, recording every proposal;
- ``diagnose``: probes of the trained drafter and the rules that turn evidence into a verdict;
- ``serve_check``: the whole check, phase by phase, with progress lines.
"""
