"""One run on one node: the engine, the run it owns, the target and drafter workers, the queues between them, control."""
