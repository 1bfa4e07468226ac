"""2D-parallel layers. Activations are ``[b/q, s, h/q]`` (batch block i, hidden block j).

Parameter layouts (rank (i, j)); "replicated over rows" = identical on the q ranks
of grid column j (``tp_row`` varies), gradients summed over them inside backward:

=============================  =============================================  =======================
layer                          local parameter                                 shared by
=============================  =============================================  =======================
``Linear2D``                   weight ``[in/q, out/q]`` = (W as ``x @ W``)_ij   unique
                               bias ``[out/q]`` = block j                       replicated over rows
``LayerNorm2D``                weight, bias ``[h/q]`` = block j                 replicated over rows
``Embedding2D``                weight ``[V, h/q]`` = hidden block j             replicated over rows
``VocabParallelEmbedding2D``   weight ``[Vp/q, h/q]`` = (E ``[Vp, h]``)_ij      unique
``LMHead2D``                   weight ``[Vp/q, h/q]`` = (E ``[Vp, h]``)_ij      unique (may be tied)
``HeadRMSNorm2D``              weight ``[d]`` (one head's width), whole         replicated over the grid
=============================  =============================================  =======================

``Vp`` is the vocabulary ``V`` padded to a multiple of q (``padded_vocab``: any Hugging Face vocabulary runs
at any q): the rows past ``V`` are zero and no token's; the loss leaves their logits out of the softmax
(``vocab=V``), so their gradients are zero and they stay zero; every dense view (``to_dense``,
``dense_state_dict``, ``dense_grads``, ``dense_layout``: checkpoints, export) holds the ``V`` real rows only.

Every parameter carries ``tensor2d_replicated_over``: ``()``, ``("tp_row",)`` or ``("tp_row", "tp_col")``
(for gradient-norm clipping). Each layer has ``from_dense(module, mesh)`` (slices
locally, no communication), ``to_dense()`` / ``dense_state_dict()`` / ``dense_grads()``
(gather over the grid; collective: every grid rank must call them) and
``dense_layout()`` (where each local parameter sits in its dense tensor; no
communication — what layout-free checkpoints are written from). Their common base and the
layout pieces are :mod:`.layer_base`'s; the cross entropy's autograd function is in :mod:`.cross_entropy`.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel4d.config.rules.tensor2d import padded_vocab
from parallel4d.distributed import comm
from parallel4d.tensor2d.checks import check_divisible
from parallel4d.tensor2d.cross_entropy import VocabParallelCE
from parallel4d.tensor2d.grid import (Grid, block_of, gather_blocks, gather_columns,
                                      reduce_scatter_batch, replicated_over_grid, replicated_over_rows)
from parallel4d.tensor2d.layer_base import (HALF, DenseLayout, Layer2D, box_at, index_runs, new_param, vocab_block_layout,
                                            vocab_rows)
from parallel4d.tensor2d.summa import RowwiseFP8, summa_ab, summa_abt


class Linear2D(Layer2D):
    """``y = x @ W + b``: x ``[b/q, s, in/q]`` → y ``[b/q, s, out/q]`` via SUMMA AB
    (forward 1 SUMMA, backward 2: dX = abt(dY, W), dW = atb(X, dY)). ``fp8`` (a :class:`~.summa.RowwiseFP8`,
    set by ``train.fp8: rowwise`` on the blocks' linears; None: off): the three products in FP8 with the
    scales one process would use, their panels broadcast in eight bits."""

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, *, name: str = "linear",
                 overlap: bool = True, dtype=None, device=None, of: "Linear2D | None" = None):
        """``of``: a layer of the same shape whose Parameters (weight, bias) and output order this one
        holds instead of new ones (a subclass adding to a converted layer keeps its weights and names)."""
        super().__init__(mesh, name)
        q = self.grid.q
        check_divisible(f"{name}.in_features", in_features, q)
        check_divisible(f"{name}.out_features", out_features, q)
        self.in_features, self.out_features, self.overlap = in_features, out_features, overlap
        self.fp8: RowwiseFP8 | None = None if of is None else of.fp8
        self.register_buffer("out_perm", None if of is None else of.out_perm, persistent=False)
        self.out_order: list[int] | None = None if of is None else of.out_order
        if of is not None:
            self.weight, self.bias = of.weight, of.bias
            return
        device = device or mesh.device
        self.weight = new_param(torch.empty(in_features // q, out_features // q, dtype=dtype, device=device))
        self.bias = new_param(torch.zeros(out_features // q, dtype=dtype, device=device), ("tp_row",)) if bias else None
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_dense(cls, module: nn.Module, mesh, *, name: str = "linear", out_perm: torch.Tensor | None = None,
                   overlap: bool = True) -> "Linear2D":
        """From an ``nn.Linear``-like module (``weight [out, in]``, optional ``bias``).

        ``out_perm`` (a list of ints) reorders the output features first (dense feature
        ``out_perm[k]`` becomes feature k); ``to_dense`` undoes it."""
        w = module.weight.detach()
        b = getattr(module, "bias", None)
        out_f, in_f = w.shape
        out_order = None
        if out_perm is not None:
            out_order, out_perm = list(out_perm), torch.as_tensor(out_perm, dtype=torch.long, device=w.device)
        self = cls(in_f, out_f, mesh, bias=b is not None, name=name, overlap=overlap, dtype=w.dtype, device=w.device)
        if out_perm is not None:
            w = w[out_perm]
            b = b.detach()[out_perm] if b is not None else None
        g = self.grid
        with torch.no_grad():
            self.weight.copy_(block_of(block_of(w.t(), g.i, g.q, 0), g.j, g.q, 1))
            if b is not None:
                self.bias.copy_(block_of(b.detach(), g.j, g.q, 0))
        self.out_perm = out_perm
        # the same order as Python ints: dense_layout reads it without a tensor op (plan's fake tensors)
        self.out_order = None if out_perm is None else out_order
        return self

    @comm.eager  # SUMMA and a bias add: nothing to compile, and the labels stay out of traced code
    def forward(self, x):
        y = summa_ab(x, self.weight, self.grid, name=self.name, overlap=self.overlap, fp8=self.fp8)
        if self.bias is not None:
            # added in y's dtype, as nn.Linear does under autocast: a float32 bias would promote a
            # bf16 product, and what follows (ring attention's K/V traffic included) to float32
            y = y + replicated_over_rows(self.bias, self.grid, f"{self.name}.bias.grad").to(y.dtype)
        return y

    def _by_output(self, get) -> dict[str, torch.Tensor]:
        """The gathered tensors whose first dimension is the output features, in the layer's order
        (``out_perm``'s, when it has one)."""
        out = {"weight": gather_blocks(get(self.weight), self.grid).t()}
        if self.bias is not None:
            out["bias"] = gather_columns(get(self.bias), self.grid)
        return out

    def _dense(self, get):
        out = self._by_output(get)
        perm = self.out_perm
        if perm is not None:
            inv = torch.argsort(perm)
            out = {k: v[inv] for k, v in out.items()}
        return {k: v.contiguous() for k, v in out.items()}

    def output_runs(self) -> list[tuple[int, int, int]]:
        """``(dense start, local start, length)`` of this grid column's output features (one run, or
        with ``out_perm`` one per part: qkv's rows are three runs, from q, k and v)."""
        g = self.grid
        n_out = self.out_features // g.q
        mine = list(range(g.j * n_out, (g.j + 1) * n_out))  # my output features, in local order
        if self.out_perm is not None:
            mine = self.out_order[g.j * n_out:(g.j + 1) * n_out]
        return index_runs(mine)

    def dense_layout(self) -> dict[str, DenseLayout]:
        g = self.grid
        n_in = self.in_features // g.q
        runs = self.output_runs()
        out = {"weight": ((self.out_features, self.in_features),  # local [in/q, out/q] holds Wᵀ's block
                          lambda t: [((d, g.i * n_in), t.t()[k:k + n]) for d, k, n in runs])}
        if self.bias is not None:
            out["bias"] = ((self.out_features,), lambda t: [((d,), t[k:k + n]) for d, k, n in runs])
        return out

    def to_dense(self) -> nn.Linear:
        sd = self.dense_state_dict()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        dtype=self.weight.dtype, device=self.weight.device)
        lin.load_state_dict(sd)
        return lin


class LayerNorm2D(Layer2D):
    """LayerNorm over the full hidden dim of ``[b/q, s, h/q]`` blocks.

    Two-pass statistics in fp32 (mean first, then the centred second moment), each a
    sum all-reduced over ``along_j`` (``tp_col`` varies: my grid row, which holds the
    other hidden blocks of the same tokens)."""

    def __init__(self, hidden: int, mesh, eps: float = 1e-5, *, name: str = "layernorm", dtype=None, device=None):
        super().__init__(mesh, name)
        check_divisible(f"{name}.normalized_shape", hidden, self.grid.q)
        self.hidden, self.eps = hidden, eps
        device = device or mesh.device
        n = hidden // self.grid.q
        self.weight = new_param(torch.ones(n, dtype=dtype, device=device), ("tp_row",))
        self.bias = new_param(torch.zeros(n, dtype=dtype, device=device), ("tp_row",))

    @classmethod
    def from_dense(cls, module: nn.Module, mesh, *, name: str = "layernorm") -> "LayerNorm2D":
        (hidden,) = tuple(module.normalized_shape)
        if module.weight is None or module.bias is None:
            raise ValueError(f"{name}: LayerNorm2D needs elementwise_affine=True with a bias")
        self = cls(hidden, mesh, eps=module.eps, name=name, dtype=module.weight.dtype, device=module.weight.device)
        g = self.grid
        with torch.no_grad():
            self.weight.copy_(block_of(module.weight.detach(), g.j, g.q, 0))
            self.bias.copy_(block_of(module.bias.detach(), g.j, g.q, 0))
        return self

    def forward(self, x):
        xf = x.float() if x.dtype in HALF else x
        mean = self.row_sum(xf.sum(-1, keepdim=True)) / self.hidden
        xc = xf - mean
        var = self.row_sum((xc * xc).sum(-1, keepdim=True)) / self.hidden
        y = xc * torch.rsqrt(var + self.eps)
        return (y * self.replicated("weight") + self.replicated("bias")).to(x.dtype)

    def _dense(self, get):
        return {"weight": gather_columns(get(self.weight), self.grid),
                "bias": gather_columns(get(self.bias), self.grid)}

    def dense_layout(self) -> dict[str, DenseLayout]:
        box = box_at(self.grid.j * (self.hidden // self.grid.q))
        return {"weight": ((self.hidden,), box), "bias": ((self.hidden,), box)}

    def to_dense(self) -> nn.LayerNorm:
        ln = nn.LayerNorm(self.hidden, eps=self.eps, dtype=self.weight.dtype, device=self.weight.device)
        ln.load_state_dict(self.dense_state_dict())
        return ln


class RMSNorm2D(Layer2D):
    """RMSNorm over the full hidden dim of ``[b/q, s, h/q]`` blocks: ``x / rms(x) · weight``, the
    sum of squares (fp32 for half inputs) all-reduced over ``along_j`` (my grid row)."""

    def __init__(self, hidden: int, mesh, eps: float = 1e-6, *, name: str = "rmsnorm", dtype=None, device=None):
        super().__init__(mesh, name)
        check_divisible(f"{name}.hidden", hidden, self.grid.q)
        self.hidden, self.eps = hidden, eps
        self.weight = new_param(torch.ones(hidden // self.grid.q, dtype=dtype, device=device or mesh.device),
                                ("tp_row",))

    @classmethod
    def from_dense(cls, module: nn.Module, mesh, *, name: str = "rmsnorm") -> "RMSNorm2D":
        """From a module with ``weight [h]`` and ``eps``."""
        (hidden,) = tuple(module.weight.shape)
        self = cls(hidden, mesh, eps=module.eps, name=name, dtype=module.weight.dtype, device=module.weight.device)
        with torch.no_grad():
            self.weight.copy_(block_of(module.weight.detach(), self.grid.j, self.grid.q, 0))
        return self

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        sq = self.row_sum((xf * xf).sum(-1, keepdim=True)) / self.hidden
        y = (xf * torch.rsqrt(sq + self.eps)).to(x.dtype)
        return self.replicated("weight") * y

    def _dense(self, get):
        return {"weight": gather_columns(get(self.weight), self.grid)}

    def dense_layout(self) -> dict[str, DenseLayout]:
        return {"weight": ((self.hidden,), box_at(self.grid.j * (self.hidden // self.grid.q)))}


class HeadRMSNorm2D(Layer2D):
    """RMSNorm over the last dimension of whole heads (``[..., heads/q, d]``: Qwen3's q and k norms),
    its weight ``[d]`` on every grid rank. No forward communication (each head is whole here); the
    backward sums the weight's gradient over the grid (rows: other batch blocks, columns: other heads)."""

    def __init__(self, width: int, mesh, eps: float = 1e-6, *, name: str = "head_rmsnorm", dtype=None, device=None):
        super().__init__(mesh, name)
        self.width, self.eps = width, eps
        self.weight = new_param(torch.ones(width, dtype=dtype, device=device or mesh.device), ("tp_row", "tp_col"))

    @classmethod
    def from_dense(cls, module: nn.Module, mesh, *, name: str = "head_rmsnorm") -> "HeadRMSNorm2D":
        """From a module with ``weight [d]`` and ``eps``."""
        (width,) = tuple(module.weight.shape)
        self = cls(width, mesh, eps=module.eps, name=name, dtype=module.weight.dtype, device=module.weight.device)
        with torch.no_grad():
            self.weight.copy_(module.weight.detach())
        return self

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return replicated_over_grid(self.weight, self.grid, f"{self.name}.weight.grad") * y

    def _dense(self, get):
        return {"weight": get(self.weight)}

    def dense_layout(self) -> dict[str, DenseLayout]:
        return {"weight": ((self.width,), box_at(0))}


class Embedding2D(Layer2D):
    """Table ``[V, h]`` split by hidden block j (replicated over rows): ids of my batch
    block (any shape, e.g. ``[b/q, s]`` tokens or ``[s]`` positions) → ``[..., h/q]``.
    No forward communication; the backward sums the weight gradient over rows.
    Used for the learned position embedding."""

    def __init__(self, num_embeddings: int, dim: int, mesh, *, name: str = "embedding", dtype=None, device=None):
        super().__init__(mesh, name)
        check_divisible(f"{name}.embedding_dim", dim, self.grid.q)
        self.num_embeddings, self.dim = num_embeddings, dim
        device = device or mesh.device
        self.weight = new_param(torch.empty(num_embeddings, dim // self.grid.q, dtype=dtype, device=device),
                                ("tp_row",))
        nn.init.normal_(self.weight)

    @classmethod
    def from_dense(cls, module: nn.Module, mesh, *, name: str = "embedding") -> "Embedding2D":
        v, h = module.weight.shape
        self = cls(v, h, mesh, name=name, dtype=module.weight.dtype, device=module.weight.device)
        with torch.no_grad():
            self.weight.copy_(block_of(module.weight.detach(), self.grid.j, self.grid.q, 1))
        return self

    def forward(self, ids):
        return F.embedding(ids, replicated_over_rows(self.weight, self.grid, f"{self.name}.weight.grad"))

    def _dense(self, get):
        return {"weight": gather_columns(get(self.weight), self.grid)}

    def dense_layout(self) -> dict[str, DenseLayout]:
        return {"weight": ((self.num_embeddings, self.dim), box_at(0, self.grid.j * (self.dim // self.grid.q)))}

    def to_dense(self) -> nn.Embedding:
        e = nn.Embedding(self.num_embeddings, self.dim, dtype=self.weight.dtype, device=self.weight.device)
        e.load_state_dict(self.dense_state_dict())
        return e


def _vocab_block(table: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Block (i, j) ``[Vp/q, h/q]`` of a dense ``[V, h]`` table padded with zero rows to ``Vp``
    (:func:`vocab_rows`); the dense table is read, never copied whole."""
    start, real = vocab_rows(table.shape[0], grid)
    out = table.new_zeros(padded_vocab(table.shape[0], grid.q) // grid.q, table.shape[1] // grid.q)
    out[:real] = table.detach()[start:start + real].chunk(grid.q, dim=1)[grid.j]
    return out


def _zero_padding(weight: torch.Tensor, vocab: int, grid: Grid) -> None:
    """Zero the padded rows (past ``vocab``) of vocab block i."""
    with torch.no_grad():
        weight[vocab_rows(vocab, grid)[1]:].zero_()


class VocabParallelEmbedding2D(Layer2D):
    """Table ``E[V, h]`` as q×q blocks: rank (i, j) holds vocab block i, hidden block j; ``V``
    padded to ``Vp`` (a multiple of q) with zero rows no id reaches.

    ids ``[b/q, s]`` (my batch block) → ``[b/q, s, h/q]``. The ranks of my grid column
    (``along_i``) hold every vocab block of hidden block j: they all-gather the ids
    (``[b, s]``), embed the ids of their vocab block (others → 0) and reduce-scatter over
    the batch dim, which sums the vocab partials and hands batch block i back to row i.
    Backward: all-gather of the output gradient, local scatter-add. Same layout as
    :class:`LMHead2D`, so the two can share the weight."""

    def __init__(self, num_embeddings: int, dim: int, mesh, *, name: str = "vocab_embedding", dtype=None, device=None):
        super().__init__(mesh, name)
        q = self.grid.q
        check_divisible(f"{name}.embedding_dim", dim, q)
        self.num_embeddings, self.dim = num_embeddings, dim
        self.vocab_start = vocab_rows(num_embeddings, self.grid)[0]
        device = device or mesh.device
        self.weight = new_param(torch.empty(padded_vocab(num_embeddings, q) // q, dim // q, dtype=dtype,
                                            device=device))
        nn.init.normal_(self.weight)
        _zero_padding(self.weight, num_embeddings, self.grid)
        self._dense_source = None

    @classmethod
    def from_dense(cls, module: nn.Module, mesh, *, name: str = "vocab_embedding") -> "VocabParallelEmbedding2D":
        v, h = module.weight.shape
        self = cls(v, h, mesh, name=name, dtype=module.weight.dtype, device=module.weight.device)
        with torch.no_grad():
            self.weight.copy_(_vocab_block(module.weight, self.grid))
        # Remembered (weakly) so that a tied dense LM head can be recognised.
        self._dense_source = weakref.ref(module.weight)
        return self

    def converted_from(self, weight: torch.Tensor) -> bool:
        """Whether this table was converted from the dense tensor ``weight``."""
        return self._dense_source is not None and self._dense_source() is weight

    def forward(self, ids):
        g = self.grid
        all_ids = g.comm.all_gather(ids.contiguous(), g.along_i, dim=0, stats=g.stats, label=f"{self.name}.ids")
        local = all_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_batch(emb, g, f"{self.name}.reduce_scatter")

    def _dense(self, get):
        return {"weight": gather_blocks(get(self.weight), self.grid)[:self.num_embeddings]}

    def dense_layout(self) -> dict[str, DenseLayout]:
        return {"weight": vocab_block_layout(self.num_embeddings, self.dim, self.grid)}

    def to_dense(self) -> nn.Embedding:
        e = nn.Embedding(self.num_embeddings, self.dim, dtype=self.weight.dtype, device=self.weight.device)
        e.load_state_dict(self.dense_state_dict())
        return e


class LMHead2D(Layer2D):
    """Logits = x·Eᵀ (no bias) via SUMMA ABᵀ: x ``[b/q, s, h/q]`` → ``[b/q, s, Vp/q]``
    (batch block i, vocab block j). ``E [V, h]`` is stored like
    :class:`VocabParallelEmbedding2D` (vocab block i, hidden block j, padded to ``Vp`` rows) and, when
    tied, *is* that layer's Parameter. The padded logits (columns past ``V``) are zero: the loss leaves
    them out (:class:`VocabParallelCrossEntropy2D` with ``vocab=V``)."""

    def __init__(self, hidden: int, vocab: int, mesh, *, name: str = "lm_head", weight: nn.Parameter | None = None,
                 overlap: bool = True, dtype=None, device=None):
        super().__init__(mesh, name)
        q = self.grid.q
        check_divisible(f"{name}.hidden", hidden, q)
        self.hidden, self.vocab, self.overlap = hidden, vocab, overlap
        rows = padded_vocab(vocab, q) // q
        if weight is None:
            weight = new_param(torch.empty(rows, hidden // q, dtype=dtype, device=device or mesh.device))
            nn.init.normal_(weight, 0.0, 0.02)
            _zero_padding(weight, vocab, self.grid)
        elif tuple(weight.shape) != (rows, hidden // q):
            raise ValueError(f"{name}: tied weight has local shape {tuple(weight.shape)}, "
                             f"expected [Vp/q, h/q] = [{rows}, {hidden // q}] (V={vocab} padded to a multiple of q)")
        self.weight = weight

    @classmethod
    def from_dense(cls, module: nn.Module, mesh, *, name: str = "lm_head", tied: VocabParallelEmbedding2D | None = None,
                   overlap: bool = True) -> "LMHead2D":
        """From a module with ``weight [V, h]`` (``nn.Linear(h, V, bias=False)`` or the dense
        ``Head``). With ``tied``, share that embedding's Parameter (its layout and the
        dense weight's shape are checked)."""
        if getattr(module, "bias", None) is not None:
            raise ValueError(f"{name}: LMHead2D has no bias; the dense LM head must use bias=False")
        v, h = module.weight.shape
        if tied is not None:
            if not isinstance(tied, VocabParallelEmbedding2D) or (tied.num_embeddings, tied.dim) != (v, h):
                raise ValueError(f"{name}: can only tie to a VocabParallelEmbedding2D of shape [{v}, {h}]")
            return cls(h, v, mesh, name=name, weight=tied.weight, overlap=overlap)
        self = cls(h, v, mesh, name=name, overlap=overlap, dtype=module.weight.dtype, device=module.weight.device)
        with torch.no_grad():
            self.weight.copy_(_vocab_block(module.weight, self.grid))
        return self

    def forward(self, x):
        return summa_abt(x, self.weight, self.grid, name=self.name, overlap=self.overlap)

    def _dense(self, get):
        return {"weight": gather_blocks(get(self.weight), self.grid)[:self.vocab]}

    def dense_layout(self) -> dict[str, DenseLayout]:
        return {"weight": vocab_block_layout(self.vocab, self.hidden, self.grid)}

    def to_dense(self) -> nn.Linear:
        lin = nn.Linear(self.hidden, self.vocab, bias=False, dtype=self.weight.dtype, device=self.weight.device)
        lin.load_state_dict(self.dense_state_dict())
        return lin


class VocabParallelCrossEntropy2D(nn.Module):
    """Mean (or summed) token cross entropy of vocab-parallel logits.

    logits ``[b/q, s, Vp/q]`` (batch block i, vocab block j; any leading dims), targets
    ``[b/q, s]`` (batch block i, replicated over j) → scalar loss over the grid's whole
    batch, equal on every grid rank. Numerically stable (global max subtracted; fp32),
    ``ignore_index`` tokens count neither in the sum nor in the mean's denominator,
    optional ``label_smoothing`` as in ``F.cross_entropy``. ``vocab``: the real vocabulary ``V``
    when the logits are padded to ``Vp`` (:class:`LMHead2D`'s): the columns past it are left out of
    the softmax (and of label smoothing), exactly; None: every column is real. Data-parallel
    replicas each see their own mean: the engine averages gradients over ``dp``."""

    def __init__(self, mesh, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                 *, name: str = "cross_entropy", vocab: int | None = None):
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"{name}.reduction={reduction!r} must be 'mean' or 'sum'")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"{name}.label_smoothing={label_smoothing} must be in [0, 1)")
        self.mesh, self.grid, self.name, self.vocab = mesh, Grid(mesh), name, vocab
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction

    @classmethod
    def from_dense(cls, module: nn.Module | None, mesh, *, name: str = "cross_entropy",
                   vocab: int | None = None) -> "VocabParallelCrossEntropy2D":
        """From an ``nn.CrossEntropyLoss`` (its ignore_index / label_smoothing / reduction) or
        ``None`` for the defaults of ``F.cross_entropy``; ``vocab``: as in the constructor."""
        if module is None:
            return cls(mesh, name=name, vocab=vocab)
        return cls(mesh, module.ignore_index, module.label_smoothing, module.reduction, name=name, vocab=vocab)

    def forward(self, logits, targets):
        if logits.shape[:-1] != targets.shape:
            raise ValueError(f"{self.name}: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                             "must share the leading dims ([b/q, s, Vp/q] and [b/q, s])")
        q, width = self.grid.q, logits.shape[-1]
        vocab = width * q if self.vocab is None else self.vocab
        if padded_vocab(vocab, q) != width * q:
            raise ValueError(f"{self.name}: logits of {width} columns per grid rank are not a vocabulary of "
                             f"{vocab} padded to q={q} ({padded_vocab(vocab, q) // q} columns)")
        return VocabParallelCE.apply(logits, targets, self.grid, self.ignore_index, self.label_smoothing,
                                      self.reduction, self.name, vocab)

    def to_dense(self) -> nn.CrossEntropyLoss:
        return nn.CrossEntropyLoss(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                                   reduction=self.reduction)


def vocab_parallel_cross_entropy(logits, targets, mesh, ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean", vocab: int | None = None):
    """Functional form of :class:`VocabParallelCrossEntropy2D`."""
    return VocabParallelCrossEntropy2D(mesh, ignore_index, label_smoothing, reduction, vocab=vocab)(logits, targets)
