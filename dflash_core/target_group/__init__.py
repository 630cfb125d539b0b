"""Target groups: one copy of the target spread over several GPUs, each GPU a process of its own
(docs/targets.md, "Targets larger than one GPU").

split.py: how a copy is split (the config's words to transformers' ``DistributedConfig``) and
what preflight refuses; fp8_split.py: the tensor-parallel split of an FP8 block-wise target, which
must cut no block; rank.py: the rank processes; group.py: the engine's side, one worker per
batch stream as a one-GPU target stage is; heads.py: the embedding and lm_head the drafter
borrows, read from the checkpoint without loading the model; verify.py: the ranks' verify
forwards (speculative decoding's and the evaluation's); remote.py: the engine's side of them, a
group as decoding's target (GroupTarget); session.py: a group outside a run (check, eval)."""
