"""Several nodes under torchrun: the process group and the per-step protocol between nodes."""
