"""The models and the objective: the frozen target, the drafter, block attention, the loss, the optimizer step, exact-tau evaluation."""
