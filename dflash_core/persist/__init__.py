"""What outlives a process besides the checkpoint (that is checkpoint/): the run folder, its
device-hours ledger, where a run's events are, the build cache."""
