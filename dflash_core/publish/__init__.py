"""``dflash-tui publish``: a checkpoint as a clean folder for a model hub (issue 46).

- source.py: which step folder a run or a path names, verified against its checksums;
- facts.py: what the run recorded about it (target, data, steps, exact tau, device-hours);
- serving.py: the vLLM and SGLang command lines of a drafter family;
- card.py: the model card (README.md) written from those facts;
- folder.py: ``publish`` itself and the output folder: written beside it and renamed into place, never over a
  folder publish did not write.
"""
