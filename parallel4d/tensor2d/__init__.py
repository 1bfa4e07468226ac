"""Optimus 2D tensor parallelism: SUMMA matmuls on a q×q grid (``tp = q²``).

Layout on grid rank (i, j) (``i = mesh.rank("tp_row")``, ``j = mesh.rank("tp_col")``):
activations ``x[b, s, h]`` → ``[b/q, s, h/q]`` (batch block i, hidden block j);
tokens/targets ``[b, s]`` → ``[b/q, s]`` (batch block i, the same on every j);
logits ``[b, s, V]`` → ``[b/q, s, Vp/q]`` (batch block i, vocab block j; ``Vp``: V padded to a multiple
of q with rows no token uses, so any vocabulary splits — they are left out of the loss's softmax and
of every dense view: state dicts, checkpoints, export).
Groups are named by the axis that varies: ``mesh.group("tp_col")`` is my grid row
(LayerNorm statistics, loss reductions over the vocab), ``mesh.group("tp_row")`` my
grid column (gradient sums of row-replicated parameters).

How a model family's dense stages become 2D stages
--------------------------------------------------
A family's 2D twin (``models/<family>/tp2d.py``: the GPT's ``TokenPositionEmbedding2D``,
``Block2D``, ``Head2D``; the Llama's ``TokenEmbedding2D``, ``LlamaBlock2D``, ``NormHead2D``) is
built from this package's layers, each stage mirroring its dense module attribute by attribute.

1. Build the dense stages with the same seed on every rank, check the shapes with
   :func:`check_tensor2d` (the config reports the same rules, from :mod:`parallel4d.config.rules.tensor2d`,
   before any process group exists).
2. Convert each stage with its twin's ``from_dense(stage, mesh, ...)``; a head given the converted
   ``embedding=`` shares its ``tok.weight`` when the dense head is tied to the token table.
   ``from_dense`` only slices local copies: no communication. If embedding and head live on
   different pipeline stages, convert the head without ``embedding=``: it gets its own copy of
   the table, and the engine must sum the two copies' gradients between the first and last stage
   (as for any tied weight under pp).
3. Data: ``split_batch(tokens, mesh)`` / ``split_batch(targets, mesh)`` give row i its
   batch block ``[b/q, s]``; under dp each dp replica first takes its own ``b/dp`` slice.
   Forward stage by stage; loss ``loss_2d(mesh, vocab=V)(logits, targets)`` (a
   :class:`VocabParallelCrossEntropy2D`) is the token mean over the grid's batch, identical on
   all q² ranks; call ``backward()`` on it on every rank.
4. Gradients: every parameter's ``.grad`` after backward is the exact dense gradient of
   its local block — parameters replicated over grid rows (``tensor2d_replicated_over ==
   ("tp_row",)``: all biases, norm gains/biases, the position table) get their
   gradient summed over ``mesh.group("tp_row")`` inside the backward; a per-head norm's
   weight (``HeadRMSNorm2D``, Qwen3's q and k norms) is on every grid rank,
   ``("tp_row", "tp_col")``, its gradient summed over both. The engine only averages over ``dp`` as usual, and a
   plain optimizer (e.g. AdamW, weight decay included) on the local tensors equals the
   dense one, since replicas see identical parameters and gradients. A global gradient
   norm must count replicated parameters once (divide their squared norm by q when
   summing over the grid, by q² for one on every grid rank).
5. ``dense_state_dict()`` / ``dense_grads()`` on each converted stage (a :class:`Composite2D`)
   gather the dense tensors under the dense module's keys (collective over the grid).

Public API: ``summa_ab, summa_abt, summa_atb`` (autograd; backward of each uses the
other two; ``fp8=RowwiseFP8()``: their products in FP8, the panels in eight bits), ``Linear2D, LayerNorm2D, RMSNorm2D, HeadRMSNorm2D, Embedding2D, VocabParallelEmbedding2D, LMHead2D,
VocabParallelCrossEntropy2D`` (``from_dense`` / ``to_dense``), ``Composite2D, Head2D, sdpa_attention,
loss_2d``, ``scatter_2d, gather_2d, split_batch``, ``check_tensor2d``. This package never imports a
model: the families import it.
"""

from parallel4d.tensor2d.checks import check_tensor2d
from parallel4d.tensor2d.composite import Composite2D, Head2D, loss_2d, sdpa_attention
from parallel4d.tensor2d.grid import Grid, gather_2d, scatter_2d, split_batch
from parallel4d.tensor2d.layers import (Embedding2D, HeadRMSNorm2D, LayerNorm2D, Linear2D, RMSNorm2D, LMHead2D,
                                       VocabParallelCrossEntropy2D, VocabParallelEmbedding2D,
                                       vocab_parallel_cross_entropy)
from parallel4d.tensor2d.summa import RowwiseFP8, summa_ab, summa_abt, summa_atb

__all__ = [
    "summa_ab", "summa_abt", "summa_atb", "RowwiseFP8",
    "Linear2D", "LayerNorm2D", "RMSNorm2D", "HeadRMSNorm2D", "Embedding2D", "VocabParallelEmbedding2D", "LMHead2D",
    "VocabParallelCrossEntropy2D", "vocab_parallel_cross_entropy",
    "Composite2D", "Head2D", "loss_2d", "sdpa_attention",
    "scatter_2d", "gather_2d", "split_batch", "Grid", "check_tensor2d",
]
