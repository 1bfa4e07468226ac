"""Ring attention inside an unmodified ``transformers`` model (the ``hf`` extra).

For users who keep their own ``transformers`` model code::

    from parallel4d.integrations.transformers import use_ring_attention, shard_sequence
    use_ring_attention(mesh)                                  # once per process, after the mesh
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="parallel4d_ring")
    ids, position_ids = shard_sequence(mesh, input_ids)       # [b, s] → [b, s/sp], global positions
    logits = model(ids, position_ids=position_ids).logits     # this rank's tokens

Packed documents and padded batches (:func:`shard_packed`): documents begin where ``position_ids``
restart (as transformers' flash-attention path infers them) and where the padding mask changes; each
query attends its own document only (padding is a document no real token attends), and rotary rotates
each document from its own position 0::

    ids, position_ids, documents = shard_packed(mesh, input_ids, position_ids=pos, attention_mask=mask)
    logits = model(ids, position_ids=position_ids, documents=documents).logits

(labels: -100 where a token's next one starts another document, and on padding).

Each rank runs the model on its sequence shard (``sequence.layout``: zigzag or contiguous)
with the tokens' *global* ``position_ids``, so rotary embeddings rotate as in the whole
sequence; every attention layer then calls :func:`parallel4d.sequence.ring_attention` over
``mesh.group("sp")`` (grouped-query heads included). Attention dropout in training is refused
(transformers' mask comes from torch's RNG; parallel4d's own models draw theirs per dense element). The causal mask is the ring's own:
``transformers`` builds none for this implementation. Shift the labels on the whole
sequence and shard them the same way; a rank's loss is the mean over its tokens, and the
gradients averaged over ``sp`` are the whole sequence's.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from parallel4d.data.packing import document_positions
from parallel4d.distributed.mesh import Mesh
from parallel4d.sequence import positions_for, ring_attention, split_sequence
from parallel4d.sequence.documents import Documents

NAME = "parallel4d_ring"


def use_ring_attention(mesh: Mesh, layout: str = "zigzag", name: str = NAME) -> str:
    """Register ring attention over ``mesh``'s ``sp`` axis as ``attn_implementation=name``
    (and a mask function that builds no mask); returns ``name``. Calling it again re-binds
    ``name`` to this mesh."""
    group, stats, timeout_s, deadlines = mesh.group("sp"), mesh.comm_stats, mesh.timeout_s, mesh.deadlines

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                   documents: Documents | None = None, **kwargs):
        """``transformers``' attention interface: q ``[b, a, s/sp, d]``, k, v ``[b, kv, s/sp, d]`` →
        ``([b, s/sp, a, d], None)``; ``documents``: the batch's packed documents (:func:`shard_packed`),
        passed to the model's forward."""
        if dropout:
            raise ValueError(f"{name}: attention dropout {dropout} in training is not supported: transformers "
                             "draws its mask from torch's RNG, which the ring's shards cannot draw alike; set the "
                             "model's attention_dropout to 0, or train parallel4d's own model, whose "
                             "model.attention_dropout every layout draws exactly")
        if attention_mask is not None:
            raise ValueError(f"{name}: got an attention mask; ring attention applies its own causal mask: for "
                             "padding or packed documents give the mask to shard_packed(...) and pass its documents= "
                             "to the model instead")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = ring_attention(query, key, value, group, causal=bool(causal), layout=layout, scale=scaling,
                             stats=stats, timeout_s=timeout_s, deadlines=deadlines, documents=documents)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_mask)
    return name


def _no_mask(*args, attention_mask=None, **kwargs):
    """The ring masks causally by global position itself (and by document, :func:`shard_packed`)."""
    if attention_mask is not None:
        raise ValueError(f"{NAME}: the model got an attention_mask; give the padding mask to "
                         "shard_packed(mesh, input_ids, attention_mask=...) and pass its documents= to the model")
    return None


def shard_sequence(mesh: Mesh, input_ids: torch.Tensor, layout: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[b, s/sp]`` shard of ``input_ids`` ``[b, s]`` and its global ``position_ids`` ``[1, s/sp]``."""
    group = mesh.group("sp")
    ids = split_sequence(input_ids, group, dim=1, layout=layout)
    positions = positions_for(input_ids.shape[1], group, layout, device=input_ids.device)
    return ids, positions.unsqueeze(0)


def shard_packed(mesh: Mesh, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, layout: str = "zigzag"):
    """Packed documents and padding of a ``[b, s]`` batch for ring attention: ``(ids [b, s/sp],
    position_ids [b, s/sp], documents)``. A document begins at position 0, where ``position_ids`` restart
    at 0 and where ``attention_mask`` (1 real, 0 padding) changes; ``position_ids`` default to each
    document's own ``0, 1, …``. Pass ``documents=documents`` to the model's forward, not the mask. The
    boundaries are read on the host (one copy of ``[b, s]`` if the tensors are on a GPU)."""
    starts = torch.zeros(input_ids.shape, dtype=torch.bool)
    starts[:, 0] = True
    if position_ids is not None:
        starts |= position_ids.expand(input_ids.shape).cpu() == 0
    if attention_mask is not None:
        mask = attention_mask.cpu()
        starts[:, 1:] |= mask[:, 1:] != mask[:, :-1]
    positions = (position_ids.expand(input_ids.shape) if position_ids is not None
                 else document_positions(starts).to(input_ids.device))
    group = mesh.group("sp")
    return (split_sequence(input_ids, group, dim=1, layout=layout),
            split_sequence(positions, group, dim=1, layout=layout),
            Documents.from_starts(starts, device=input_ids.device))
