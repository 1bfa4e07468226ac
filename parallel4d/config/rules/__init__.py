"""Each technique's rules in one torch-free place, one module each; every rule is a function that
returns its messages (None or [] when it holds), naming the fields and a value that works.

* ``common``: what the messages say with (nearest values, "X is not divisible by Y; use ...",
  "did you mean"), the bottom of the import graph;
* ``tensor2d``, ``pipeline``, ``sequence``, ``hetero``: the techniques' rules, also raised by the
  strategies themselves (``tensor2d/checks.py``, ``pipeline/checks.py``, ``sequence/layout.py``);
* ``data`` (the batch split, the sources, held-out data), ``training`` (dtypes, fused kernels,
  TensorBoard, the learning-rate schedule), ``deepspeed`` (the section's rules that need no
  DeepSpeed), ``job`` (the local launcher's and torchrun's limits), ``lora`` and ``moe`` (what adapters
  and MoE layers need), ``fp8`` (``train.fp8``: float64 refused, the layouts it does not run in yet).

``config/checks.py`` lists a job file's rules in the order their messages appear.
"""
