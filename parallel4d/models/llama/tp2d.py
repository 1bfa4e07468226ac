"""The 2D twin of the Llama family's stages (``model.arch: llama``): token embedding, pre-norm block, head.

Like the GPT's (:mod:`parallel4d.models.gpt2.tp2d`), each mirrors its dense module of :mod:`.model`
attribute by attribute on the 2D activation layout ``[b/q, s, h/q]``; the layers are
:mod:`parallel4d.tensor2d`'s.

Heads are split over grid columns with no permutation: ``q_proj``, ``k_proj`` and ``v_proj``
are separate, each output's features are heads in order, so the column block j of
``q_proj`` is query heads ``j·a/q …`` and that of ``k_proj``/``v_proj`` the key/value heads
``j·kv/q …`` — exactly the ones those query heads read (a query head ``i`` reads key/value
head ``i // (a/kv)``), given ``kv % q == 0``. The head size ``d`` need not be ``h/a`` (Qwen3):
the projections are ``[h, a·d]`` matrices cut in q×q blocks like any other. Qwen3's q and k norms
act per head on the local ``[b/q, s, a/q, d]`` (whole heads, their weight ``[d]`` on every grid
rank: :class:`~parallel4d.tensor2d.layers.HeadRMSNorm2D`). Rotary embeddings (the dense
attention's :class:`~.rotary.Rotary`) act per head on the local ``[b/q, a/q, s, d]`` q and k with
the tokens' global ``positions`` in a sequence of ``length`` tokens. The SwiGLU product is
elementwise on the matching ``[b/q, s, I/q]`` blocks of gate and up. An MoE layer (Qwen3-MoE, Qwen2-MoE,
Mixtral) is :class:`~parallel4d.models.moe.tp2d.SparseMoE2D`: its tokens, not its weights, split over the grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel4d.models.context import ReadsContext
from parallel4d.models.dropout import Site, attend
from parallel4d.models.llama.model import Block, Embedding, Head, rotary_positions
from parallel4d.models.stages import dense_attention
from parallel4d.models.llama.rotary import Rotary, rotate
from parallel4d.models.moe.layer import SparseMoE
from parallel4d.models.moe.tp2d import SparseMoE2D
from parallel4d.tensor2d.checks import check_divisible, check_heads
from parallel4d.tensor2d.composite import Composite2D, Head2D
from parallel4d.tensor2d.layers import HeadRMSNorm2D, Linear2D, RMSNorm2D, VocabParallelEmbedding2D


class LlamaBlock2D(Composite2D, ReadsContext):
    """``x + o(attn(rope(q(n1 x)), rope(k(n1 x)), v(n1 x)))``, then ``x + down(silu(gate(n2 x)) · up(n2 x))``
    on ``[b/q, s, h/q]``; the core ``attention_fn(q, k, v, causal=...)`` sees local q
    ``[b/q, a/q, s, d]`` and k, v ``[b/q, kv/q, s, d]``. ``positions`` ``[s]``: the tokens'
    global positions (None: ``0..s-1``) in a sequence of ``length`` tokens (None: ``s``).
    ``qk_norms``: Qwen3's ``(q_norm, k_norm)``, or None. ``attn_drop``: the dense block's attention
    dropout site for this grid column's heads (None: none). ``mlp``: the SwiGLU's ``(gate, up, down)``
    :class:`Linear2D` layers, or a mixture of experts' :class:`SparseMoE2D` (its dense names under ``mlp.``)."""

    def __init__(self, norms, projections, mlp, heads: int, kv_heads: int, rotary: Rotary, attention_fn=None,
                 causal: bool = True, qk_norms=None, attn_drop: Site | None = None):
        super().__init__()
        self.attn_drop = attn_drop or Site(0.0, 1, "attention")
        self.input_layernorm, self.post_attention_layernorm = norms
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = projections
        if isinstance(mlp, SparseMoE2D):
            self.mlp = mlp
        else:
            self.gate_proj, self.up_proj, self.down_proj = mlp
        self.q_norm, self.k_norm = qk_norms or (None, None)
        q = self.q_proj.grid.q
        self.local_heads, self.local_kv_heads = heads // q, kv_heads // q
        self.rotary, self.causal = rotary, causal
        self.attention_fn = attention_fn or dense_attention
        self.positions: torch.Tensor | None = None
        self.length: int | None = None

    @classmethod
    def from_dense(cls, block: Block, mesh, attention_fn=None, *, name: str = "block",
                   overlap: bool = True) -> "LlamaBlock2D":
        """From a dense Llama block (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
        ``self_attn.heads/kv_heads/rotary``, Qwen3's ``self_attn.q_norm/k_norm``); divisibility checked
        before any collective."""
        attn, mlp, q = block.self_attn, block.mlp, mesh.q
        width = attn.q_proj.weight.shape[0]  # heads · head size: whole heads per grid column
        check_heads(attn.heads, width, q, heads_field=f"{name}.self_attn.heads", hidden_field=f"{name}.attention width")
        check_divisible(f"{name}.self_attn.kv_heads", attn.kv_heads, q)

        def lin(module, part):
            return Linear2D.from_dense(module, mesh, name=f"{name}.{part}", overlap=overlap)

        qk_norms = tuple(HeadRMSNorm2D.from_dense(getattr(attn, p), mesh, name=f"{name}.self_attn.{p}")
                         for p in ("q_norm", "k_norm")) if attn.qk_norm else None
        return cls((RMSNorm2D.from_dense(block.input_layernorm, mesh, name=f"{name}.input_layernorm"),
                    RMSNorm2D.from_dense(block.post_attention_layernorm, mesh, name=f"{name}.post_attention_layernorm")),
                   tuple(lin(getattr(attn, p), f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                   SparseMoE2D.from_dense(mlp, mesh, name=f"{name}.mlp") if isinstance(mlp, SparseMoE) else
                   tuple(lin(getattr(mlp, p), f"mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj")),
                   attn.heads, attn.kv_heads, attn.rotary, attention_fn, causal=attn.causal, qk_norms=qk_norms,
                   attn_drop=attn.attn_drop.shifted(mesh.rank("tp_col") * (attn.heads // q)))

    def _parts(self):
        norms = [(f"self_attn.{p}.", getattr(self, p)) for p in ("q_norm", "k_norm")] if self.q_norm else []
        mlp = [("mlp.", self.mlp)] if self.sparse else \
            [(f"mlp.{p}.", getattr(self, p)) for p in ("gate_proj", "up_proj", "down_proj")]
        return [("input_layernorm.", self.input_layernorm), ("post_attention_layernorm.", self.post_attention_layernorm),
                *((f"self_attn.{p}.", getattr(self, p)) for p in ("q_proj", "k_proj", "v_proj", "o_proj")), *norms,
                *mlp]

    @property
    def sparse(self) -> bool:
        """Whether the block's MLP is a mixture of experts."""
        return isinstance(getattr(self, "mlp", None), SparseMoE2D)

    def attention(self, x):
        """``[b/q, s, h/q]`` → ``[b/q, s, h/q]`` (my heads only; no communication in the core)."""
        bq, s, _ = x.shape
        q = self.q_proj(x).view(bq, s, self.local_heads, -1)
        k = self.k_proj(x).view(bq, s, self.local_kv_heads, -1)
        v = self.v_proj(x).view(bq, s, self.local_kv_heads, -1).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = self.rotary.table(rotary_positions(self, s, x.device), self.length or s, q.dtype)
        mask = self.attn_drop.attention(bq, self.local_heads, x.device)
        y = attend(self.attention_fn, rotate(q, cos, sin), rotate(k, cos, sin), v, self.causal, mask,
                   self.documents())
        return self.o_proj(y.transpose(1, 2).reshape(bq, s, -1))

    def forward(self, x):
        x = x + self.attention(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        if self.sparse:
            return x + self.mlp(h)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TokenEmbedding2D(Composite2D):
    """Mirrors the dense Llama ``Embedding`` (``tok`` only): tokens ``[b/q, s]`` → ``[b/q, s, h/q]``."""

    def __init__(self, tok: VocabParallelEmbedding2D):
        super().__init__()
        self.tok = tok

    @classmethod
    def from_dense(cls, embed: Embedding, mesh, *, name: str = "embed") -> "TokenEmbedding2D":
        return cls(VocabParallelEmbedding2D.from_dense(embed.tok, mesh, name=f"{name}.tok"))

    def _parts(self):
        return [("tok.", self.tok)]

    def forward(self, tokens):
        return self.tok(tokens)


class NormHead2D(Head2D):
    """Mirrors the dense Llama ``Head``: RMSNorm ``norm`` then the LM head (shared with the
    embedding when tied). Same as :class:`Head2D` with the norm's dense name ``norm``."""

    norm_prefix = "norm."

    @classmethod
    def from_dense(cls, head: Head, mesh, embedding=None, *, name: str = "head",
                   overlap: bool = True) -> "NormHead2D":
        self = super().from_dense(head, mesh, embedding, name=name, overlap=overlap,
                                  norm=RMSNorm2D.from_dense(head.norm, mesh, name=f"{name}.norm"))
        return self
