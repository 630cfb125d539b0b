"""The drafter's loss in one streaming pass per row (drafter.fused_loss): DFlash's cross-entropy
(with either slot weighting), DSpark's CE + TV (+ the confidence target) and DFlash2's CE + the
selector's K-way CE, on the GPU.

``select.py`` says whether the fused path runs (torch-free of Triton: it only asks whether Triton
is installed); ``triton_kernels.py`` builds the kernels on first use (Triton is imported there,
inside a function, only on a CUDA drafter); ``autograd.py`` holds the autograd functions the
losses call (models/objective.chunked_loss and models/dspark/loss.dspark_loss with fused=True),
``selector_rows.py`` DFlash2's (models/dflash2/loss.dflash2_loss with fused=True; its row kernel
has a torch twin, which runs off CUDA, so the CPU's tests exercise the same code). The torch path
of those modules stays the CPU's path and the reference.
"""
