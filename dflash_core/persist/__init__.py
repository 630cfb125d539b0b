"""What outlives a process: checkpoints, resume, the run folder, the build cache, the data position."""
