"""The only layer that knows several strategies exist. By job:

* :mod:`.compose` — ``compose(cfg, mesh)``: pipeline → stages → ring → 2D → local model →
  parameter store → :class:`~.step.Engine` (also ``build_stages``, ``build_pipeline``, ``local_model``);
* :mod:`.model` — this rank's :class:`~.model.LocalModel` and the config's dtype and shape;
* :mod:`.batch` — a rank's share of the global batch (``local_batch``);
* :mod:`.grads` — gradient reduction over the data replicas and the whole model's gradient norm;
* :mod:`.store` — hetero vs plain as one interface (:class:`~.store.ParameterStore`);
* :mod:`.trainer` — the contract the training loop drives (:class:`~.trainer.Trainer`);
* :mod:`.step` — the :class:`~.step.Engine`: train step, evaluation, memory, checkpoints;
* :mod:`.state` — checkpoint state under the dense model's names;
* :mod:`.pretrained` — Hugging Face weights, this rank's slices only;
* :mod:`.flops` — model FLOPs per token;
* :mod:`.memory` — what a rank holds (the rules ``summary.json`` and ``parallel4d plan`` count by).
"""
