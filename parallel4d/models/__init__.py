"""The model families: one package each (``gpt2/``, ``llama/``), registered in :mod:`.registry`.

A family is its torch-free spec (``<family>/spec.py``: the ``model.arch`` name, the fields it
reads, its rules, its Hugging Face mapping, FLOPs per token), its dense single-process reference
(``<family>/model.py``, built stage by stage from ``(seed, stage)``), its 2D tensor-parallel twin
(``<family>/tp2d.py``) and its torch side (``<family>/family.py``, a :class:`.build.Family`).
:mod:`.registry` lists the specs without torch (the config reads it); :mod:`.build` gives the
shapes, stages and dense models of any family; :mod:`.hf` reads and writes Hugging Face
checkpoints. This package imports nothing itself, so the config can import the registry without torch.
"""
