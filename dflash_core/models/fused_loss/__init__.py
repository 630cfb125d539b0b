"""The drafter's loss in one streaming pass per row (drafter.fused_loss): DFlash's cross-entropy
(with either slot weighting) and DSpark's CE + TV (+ the confidence target) on the GPU.

``select.py`` says whether the fused path runs (torch-free of Triton: it only asks whether Triton
is installed); ``triton_kernels.py`` builds the kernels on first use (Triton is imported there,
inside a function, only on a CUDA drafter); ``autograd.py`` holds the autograd functions the
losses call (models/objective.chunked_loss and models/dspark/loss.dspark_loss with fused=True).
The torch path of those two modules stays the CPU's path and the reference.
"""
