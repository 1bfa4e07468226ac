"""Mixture-of-experts layers (issue 48), shared by the families whose blocks hold them (llama's now).

Not a family: no registry line of its own. A family's block holds :class:`~.layer.SparseMoE` in
place of its dense MLP in the layers :func:`~.spec.sparse_layers` selects, and its spec reads the
``model:`` fields through :class:`~.spec.MoeShape`.

* ``spec``     torch-free: :class:`MoeShape` (the fields as the model reads them), which layers are
  MoE layers, parameter and FLOP counts, a transformers ``config.json``'s MoE keys → fields, the
  Hugging Face names of a layer's tensors;
* ``routing``  the router's arithmetic (softmax, top-k, ``norm_topk_prob``), the tokens sorted by
  expert and back, and :func:`~.routing.expert_ffn` (every expert's SwiGLU over its sorted tokens: the
  one function a grouped matrix product replaces);
* ``balance``  the load-balancing loss: each layer's statistics (:class:`~.balance.LayerLoad`), the
  one function that combines them (where a collective over ranks plugs in), the family's
  ``auxiliary_loss``;
* ``layer``    the modules: ``Router`` (``gate``), ``Experts`` (weights stacked ``[E, ...]``),
  ``SparseMoE``; ``from_transformers_experts`` (transformers 5's fused expert tensors → ours).

Package ``__init__`` stays torch-free: ``spec`` is read by ``parallel4d.config``.
"""
