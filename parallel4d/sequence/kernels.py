"""Local block compute of ring attention: one (query block, key block) kernel call
returning the output *and* its log-sum-exp, the LSE merge, and the per-step loops.

Shapes: ``q [b, h, lq, d]``, ``k, v [b, h_kv, lk, d]`` with ``h % h_kv == 0`` (query
head ``i`` uses K/V head ``i // (h/h_kv)``, as SDPA's ``enable_gqa``); ``out [b, h, lq, d]``;
``lse [b, h, lq]`` (natural log of the softmax denominator, scale included).

Backends (``backend=``):

* ``math``: plain matmul/softmax in the accumulation dtype; any device and dtype.
  Scores are ``[b, h_kv, h/h_kv, lq, lk]`` — one block pair, never a full row of the sequence.
  The only kernel that takes attention dropout: ``keep [b, h, lq, lk]`` (0 or ``1/(1-p)``)
  multiplies the probabilities (normalised by the whole row's LSE, so the merge is unchanged:
  ``out = Σ_j keep·p·v``); its backward is ``dV = (P∘keep)ᵀdO``, ``dP = (dO·Vᵀ)∘keep`` and
  ``dS = P∘(dP − rowsum(dO∘O))``, exact with the final ``O``.
* ``cpu_flash``: ATen's fused CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward). Exercises the same protocol as the CUDA kernels on CPU.
* ``cudnn`` / ``flash`` / ``efficient``: ATen's CUDA cuDNN / FlashAttention-2 /
  memory-efficient SDPA ops, which return the LSE (``efficient``'s comes padded to a multiple
  of 32 rows: cut on the way out, padded again for its backward). Their backward ops are called
  per block with the **final** merged ``out`` and ``lse`` of the query rows, which makes the
  per-block gradients exact pieces of the full gradient (the softmax normaliser is the global
  one). cuDNN and flash take fp16/bf16; ``efficient`` also fp32, with no ``[lq, lk]`` scores in
  memory (``math`` holds them: ~2 GB per block pair at s=32k, sp=8, h=32 in fp32).
* ``auto`` on CUDA: the first of ``cudnn``, ``flash``, ``efficient`` (fp16/bf16) or ``efficient``
  (fp32) that this GPU runs (:data:`MIN_CAPABILITY`) and torch's own checks accept for these
  shapes (``torch.backends.cuda.can_use_*_attention``, which also honour
  ``torch.backends.cuda.enable_*_sdp``), else ``math``; ``math`` on other devices and for fp64.
  A fused backend named explicitly is refused (``ValueError``) where it cannot run.

The fused kernels get K/V expanded to ``h`` heads for GQA (a local copy of the
visiting block only; the ring still carries ``h_kv`` heads) and their dK/dV are
summed back over each query group.

Accumulators (ring output, LSE, dQ, travelling dK/dV) use :func:`acc_dtype`:
fp32 for fp16/bf16 inputs, the input dtype otherwise.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from parallel4d.sequence.layout import BlockCall

aten = torch.ops.aten

BACKENDS = ("auto", "math", "cpu_flash", "cudnn", "flash", "efficient")
_HALF = (torch.float16, torch.bfloat16)
# The fused CUDA kernels auto tries, best first, per input dtype (fp64 has none: math).
FUSED_ORDER = {torch.float16: ("cudnn", "flash", "efficient"), torch.bfloat16: ("cudnn", "flash", "efficient"),
               torch.float32: ("efficient",)}
# The oldest GPU (compute capability) each runs on: cuDNN's SDPA and FlashAttention-2 need Ampere.
MIN_CAPABILITY = {"cudnn": (8, 0), "flash": (8, 0), "efficient": (5, 0)}
_LSE_ROWS = 32  # the memory-efficient kernel's LSE is padded to a multiple of this many rows (CUDA)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of merges and gradient sums: fp32 for half types, else ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend for ``q [b, h, l, d]``; ``ValueError`` for a name that cannot run on it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        if not q.is_cuda:
            return "math"
        return choose_backend(q.dtype, _capability(q), lambda name: fused_usable(name, q))
    if backend in MIN_CAPABILITY:
        why = _cannot_run(backend, q)
        if why:
            raise ValueError(f"backend={backend!r} {why}; use backend='auto' (the fastest kernel that runs here) "
                             "or 'math'")
    if backend == "cpu_flash" and q.is_cuda:
        raise ValueError("backend='cpu_flash' runs on CPU tensors only; use 'auto', 'cudnn', 'flash' or 'efficient' "
                         "on CUDA")
    return backend


def choose_backend(dtype: torch.dtype, capability: tuple[int, int], usable) -> str:
    """``auto``'s kernel for CUDA tensors of ``dtype`` on a GPU of compute ``capability``: the first of
    :data:`FUSED_ORDER` that the GPU has (:data:`MIN_CAPABILITY`) and ``usable(name)`` accepts, else
    ``math``."""
    for name in FUSED_ORDER.get(dtype, ()):
        if tuple(capability) >= MIN_CAPABILITY[name] and usable(name):
            return name
    return "math"


def _cannot_run(name: str, q: torch.Tensor) -> str | None:
    """Why the fused kernel ``name`` cannot run on ``q``'s blocks (None when it can)."""
    if not q.is_cuda:
        return f"needs CUDA tensors (got {q.device})"
    if name not in FUSED_ORDER.get(q.dtype, ()):
        return f"does not take {q.dtype}"
    if _capability(q) < MIN_CAPABILITY[name]:
        return f"needs a GPU of compute capability {MIN_CAPABILITY[name]} or newer, this one is {_capability(q)}"
    if not fused_usable(name, q):
        return ("is refused by torch's checks for these tensors (torch.backends.cuda.can_use_*_attention with "
                "debug=True says why)")
    return None


def _capability(q: torch.Tensor) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(q.device))


_CAN_USE = {"cudnn": "can_use_cudnn_attention", "flash": "can_use_flash_attention",
            "efficient": "can_use_efficient_attention"}


def fused_usable(name: str, q: torch.Tensor) -> bool:
    """Whether torch's own checks let the fused kernel ``name`` run on blocks shaped like ``q [b, h, l, d]``
    (K/V are expanded to its heads), causal and not: the GPU, the build, the dtype, the head size, the
    strides and the user's ``torch.backends.cuda.enable_*_sdp`` switches."""
    if name == "cudnn" and not (torch.backends.cudnn.is_available() and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0):
        return False
    sdp = torch.backends.cuda
    can_use = getattr(sdp, _CAN_USE[name])
    return all(can_use(sdp.SDPAParams(q, q, q, None, 0.0, causal, False)) for causal in (False, True))


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


# --------------------------------------------------------------------------- math path


def _grouped(x: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[b, h, l, d]`` → ``[b, h_kv, g, l, d]`` in ``dtype``."""
    b, h, l, d = x.shape
    return x.to(dtype).reshape(b, hkv, h // hkv, l, d)


def _scores(q, k, causal, scale, ad, allowed=None):
    hkv = k.shape[1]
    s = torch.matmul(_grouped(q, hkv, ad), k.to(ad).unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if causal:  # top-left aligned: only used on the diagonal, where lq == lk
        lq, lk = s.shape[-2:]
        s.masked_fill_(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    if allowed is not None:  # [b, lq, lk]: packed documents' pairs (a query attends its own document only)
        s.masked_fill_(~allowed[:, None, None], float("-inf"))
    return s  # [b, h_kv, g, lq, lk]


def _finite(lse: torch.Tensor, allowed) -> torch.Tensor:
    """``lse`` with a row that attends nothing (``-inf``: every key masked) as 0, so that its
    probabilities ``exp(-inf - 0)`` are 0 rather than NaN. Only a document mask (``allowed``) leaves a
    row so: the causal diagonal keeps each row's own key, so without one ``lse`` is returned as it is."""
    return lse if allowed is None else lse.masked_fill(lse == float("-inf"), 0.0)


def _math_forward(q, k, v, causal, scale, keep=None, allowed=None):
    ad = acc_dtype(q.dtype)
    b, h, lq, d = q.shape
    s = _scores(q, k, causal, scale, ad, allowed)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(_finite(lse, allowed).unsqueeze(-1)).exp_()
    if keep is not None:  # dropout of the probabilities: the LSE stays the whole row's
        p.mul_(_grouped(keep, k.shape[1], ad))
    out = torch.matmul(p, v.to(ad).unsqueeze(2))
    return out.reshape(b, h, lq, v.shape[-1]), lse.reshape(b, h, lq)


def _math_backward(dout, q, k, v, out, lse, causal, scale, keep=None, allowed=None):
    ad = acc_dtype(q.dtype)
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    lse = _finite(lse.to(ad), allowed).reshape(b, hkv, h // hkv, lq, 1)
    p = _scores(q, k, causal, scale, ad, allowed).sub_(lse).exp_()
    do = _grouped(dout, hkv, ad)
    vv = v.to(ad).unsqueeze(2)
    kept = None if keep is None else _grouped(keep, hkv, ad)
    dv = torch.matmul(p.transpose(-1, -2) if kept is None else (p * kept).transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, vv.transpose(-1, -2))
    if kept is not None:
        dp.mul_(kept)
    delta = (do * _grouped(out, hkv, ad)).sum(-1, keepdim=True)  # rowsum(dO ∘ O) = Σ_k P·dP
    ds = p.mul_(dp.sub_(delta))
    dq = torch.matmul(ds, k.to(ad).unsqueeze(2)).mul_(scale).reshape(b, h, lq, d)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q, hkv, ad)).sum(2).mul_(scale)
    return dq, dk, dv


# --------------------------------------------------------------------------- fused paths


def _expand_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    b, hkv, l, d = x.shape
    if hkv == h:
        return x
    return x.unsqueeze(2).expand(b, hkv, h // hkv, l, d).reshape(b, h, l, d)


def _fold_kv(g: torch.Tensor, hkv: int) -> torch.Tensor:
    b, h, l, d = g.shape
    if hkv == h:
        return g
    return g.reshape(b, hkv, h // hkv, l, d).sum(2)


@functools.lru_cache(maxsize=None)
def _rng_placeholders(backend: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """RNG-state tensors of the right kind for the CUDA backward ops.

    Dropout is 0, so their values are never read; they are taken from one tiny
    forward call so that type and device are what the op expects.
    """
    t = torch.zeros(1, 1, 8, 64, device=device, dtype=torch.bfloat16)
    if backend == "flash":
        r = aten._scaled_dot_product_flash_attention(t, t, t, 0.0, False, False)
        return r[6], r[7]
    if backend == "efficient":  # fp32: every GPU it runs on takes that
        t = t.float()
        r = aten._scaled_dot_product_efficient_attention(t, t, t, None, False)
        return r[2], r[3]
    r = aten._scaled_dot_product_cudnn_attention(t, t, t, None, True, 0.0, False, False)
    return r[6], r[7]


def _fused_forward(backend, q, k, v, causal, scale):
    h = q.shape[1]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    b, _, lq, _ = q.shape
    if backend == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif backend == "flash":
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = r[0], r[1]
    elif backend == "efficient":  # its LSE has padding rows past lq
        r = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        out, lse = r[0], r[1][:, :, :lq]
    else:  # cudnn: logsumexp comes as [b, h, lq, 1]; dense inputs (row slices copied, cheap next to the kernel)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        out, lse = r[0], r[1]
    return out, lse.reshape(b, h, lq)


def _fused_backward(backend, dout, q, k, v, out, lse, causal, scale):
    h, hkv = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    lq, lk = q.shape[2], k.shape[2]
    if backend == "cpu_flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse.contiguous(), 0.0, causal, scale=scale)
    elif backend == "flash":
        seed, offset = _rng_placeholders("flash", str(q.device))
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse.contiguous(), None, None, lq, lk, 0.0, causal, seed, offset, scale=scale)
    elif backend == "efficient":  # the LSE padded back to the rows its forward gave
        seed, offset = _rng_placeholders("efficient", str(q.device))
        rows = lq if torch.version.hip else -(-lq // _LSE_ROWS) * _LSE_ROWS
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, F.pad(lse, (0, rows - lq)).contiguous(), seed, offset, 0.0, [True, True, True, False],
            causal, scale=scale)
    else:  # cuDNN wants matching dense layouts for q/k/v/out/dout
        seed, offset = _rng_placeholders("cudnn", str(q.device))
        dout, q, ke, ve, out = (x.contiguous() for x in (dout, q, ke, ve, out))
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, ke, ve, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, None, None, lq, lk,
            0.0, causal, scale=scale)
    return dq, _fold_kv(dk, hkv), _fold_kv(dv, hkv)


# --------------------------------------------------------------------------- public block ops


def _fused_only_without(keep, backend, allowed=None):
    if keep is not None:
        raise ValueError(f"backend={backend!r} cannot apply attention dropout (a mask of our own on the "
                         "probabilities); use backend='math' (or 'auto', which picks it under dropout)")
    if allowed is not None:
        raise ValueError(f"backend={backend!r} cannot mask packed documents (a mask of our own on the scores); "
                         "use backend='math' (or 'auto', which picks it for documents)")


def block_forward(q, k, v, causal: bool, scale: float, backend: str, keep=None, allowed=None):
    """Attention of one block pair → ``(out [b, h, lq, d], lse [b, h, lq])``.

    ``out`` is in the kernel's dtype (``q.dtype`` for fused kernels, the accumulation
    dtype for ``math``); ``lse`` in fp32 (fp64 for fp64 inputs). ``keep`` ``[b, h, lq, lk]``:
    attention dropout's scale of each probability; ``allowed`` ``[b, lq, lk]``: the pairs packed
    documents let attend (a row with none: ``out`` 0, ``lse`` ``-inf``) (``math`` only).
    """
    if backend == "math":
        return _math_forward(q, k, v, causal, scale, keep, allowed)
    _fused_only_without(keep, backend, allowed)
    return _fused_forward(backend, q, k, v, causal, scale)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, backend: str, keep=None, allowed=None):
    """Gradients of one block pair given the **final** ``out`` / ``lse`` of these query rows
    (``keep``, ``allowed``: the forward's dropout scales and document pairs).

    Returns ``dq [b, h, lq, d]``, ``dk, dv [b, h_kv, lk, d]`` (summed over each query group).
    """
    if backend == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale, keep, allowed)
    _fused_only_without(keep, backend, allowed)
    return _fused_backward(backend, dout, q, k, v, out, lse.to(acc_dtype(q.dtype)), causal, scale)


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor,
           empty_rows: bool = True) -> None:
    """In-place log-sum-exp merge of a block result into the running one.

    ``out = (e^lse_acc·out_acc + e^lse_blk·out_blk) / (e^lse_acc + e^lse_blk)`` is a lerp with
    weight ``σ(lse_blk − lse_acc)``; ``lse = logaddexp(lse_acc, lse_blk)``. Both forms stay
    finite for any gap between the two LSEs, and an accumulator at ``-inf`` (nothing yet)
    takes the block as is. Accumulators are ``[b, h, l, d]`` / ``[b, h, l]`` (views allowed).
    ``empty_rows=False``: the caller knows no block row attends nothing (no document mask), which
    saves the two passes that guard such a row.
    """
    if lse_blk.dtype != lse_acc.dtype:
        lse_blk = lse_blk.to(lse_acc.dtype)
    w = torch.sigmoid(lse_blk - lse_acc)
    if empty_rows:  # a block row that attends nothing (-inf) leaves the row as it is, even one with nothing yet
        w.masked_fill_(lse_blk == float("-inf"), 0.0)
    out_acc.lerp_(out_blk.to(out_acc.dtype), w.unsqueeze(-1))
    torch.logaddexp(lse_acc, lse_blk, out=lse_acc)


def _merge_traceable(out_acc, lse_acc, out_blk, lse_blk, empty_rows: bool = True) -> None:
    """:func:`merge_` in the ops ``torch.compile`` captures whole (``out=`` is a graph break there); the
    empty-row guard always on: fused, it costs no pass."""
    lse_blk = lse_blk.to(lse_acc.dtype)
    w = torch.sigmoid(lse_blk - lse_acc).masked_fill(lse_blk == float("-inf"), 0.0)
    out_acc.lerp_(out_blk.to(out_acc.dtype), w.unsqueeze(-1))
    lse_acc.copy_(torch.logaddexp(lse_acc, lse_blk))


def fused_merge(backend: str = "inductor"):
    """:func:`merge_` compiled by ``torch.compile`` (``backend``) into one pass over the accumulators:
    reads ``out_acc``, the block's ``out`` in its own dtype and both LSEs once, writes both accumulators
    once (eager: five launches and an fp32 copy of the block), falling back to :func:`merge_` where it
    does not compile (:class:`FusedOrEager`). Same signature and results as :func:`merge_`.

    Not the ring's merge: a compiled call costs the host more than the eager merge's five launches
    (on CPU, 24–30 µs against 11 µs per call at small blocks; ``benchmarks/sequence.py --glue
    --compile-merge``), which is where the ring's glue shows (many small blocks). ``benchmarks/sequence.py
    --compile-merge`` times both on a GPU, where the fused one saves the block's bytes at large blocks."""
    return FusedOrEager(torch.compile(_merge_traceable, backend=backend, dynamic=True, fullgraph=True))


class FusedOrEager:
    """A compiled merge, or :func:`merge_` from the first time torch cannot compile it here (no C compiler
    for Triton's launcher, an unsupported build), with one warning: a failed compile raises before the
    graph runs, so the eager merge then does the call's whole work."""

    def __init__(self, fused):
        self.fused, self.failed = fused, None

    def __call__(self, out_acc, lse_acc, out_blk, lse_blk, empty_rows: bool = True) -> None:
        if self.failed is None:
            try:
                return self.fused(out_acc, lse_acc, out_blk, lse_blk, empty_rows)
            except torch._dynamo.exc.TorchDynamoException as e:  # compiling failed: nothing was written yet
                self.failed = e
                warnings.warn(f"ring attention: the fused LSE merge does not compile here ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); merging eagerly (same results, "
                              "more passes)", RuntimeWarning, stacklevel=2)
        merge_(out_acc, lse_acc, out_blk, lse_blk, empty_rows)


# --------------------------------------------------------------------------- one ring step


def _rows(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``x [b, h, L, ...]``: ``x`` itself for all of them (a view costs the host
    microseconds, and a ring step takes a handful per call)."""
    return x if lo == 0 and hi == x.shape[2] else x.narrow(2, lo, hi - lo)


class QueryRows:
    """One rank's query-side tensors (each ``[b, h, L, ...]``) cut to a call's rows ``[lo, hi)`` and made
    dense once per ring pass, then reused by every step that takes the same rows: under zigzag the
    second piece's rows serve every step whose K/V block comes from a later rank (about N/2 steps),
    and the fused kernels need dense inputs (a row slice of ``[b, h, L, d]`` is not). Whole-shard rows
    are the tensors themselves (no copy)."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors
        self._cut: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def __call__(self, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        cut = self._cut.get((lo, hi))
        if cut is None:
            cut = self._cut[(lo, hi)] = tuple(_rows(x, lo, hi).contiguous() for x in self.tensors)
        return cut


def _keep(mask, c: BlockCall):
    return None if mask is None else mask(c)


def forward_step(q: QueryRows, k, v, calls: list[BlockCall], out_acc, lse_acc, scale: float, backend: str,
                 merge=merge_, mask=None, allowed=None) -> None:
    """Run one ring step's calls (queries of this rank, ``q``'s rows, × the visiting K/V block) and merge.

    ``out_acc [b, h, L, d]`` / ``lse_acc [b, h, L]`` are updated in place (rows with nothing
    accumulated yet hold ``0`` / ``-inf``). ``mask``: ``call → keep [b, h, lq, lk]``, attention
    dropout's scales of that call's block pair (None: no dropout); ``allowed``: ``call → [b, lq, lk]``,
    the pairs packed documents let attend (None: all, so that no block row is empty).
    """
    for c in calls:
        (qc,) = q(c.q_lo, c.q_hi)
        out, lse = block_forward(qc, _rows(k, c.k_lo, c.k_hi), _rows(v, c.k_lo, c.k_hi),
                                 c.causal, scale, backend, _keep(mask, c), _keep(allowed, c))
        merge(_rows(out_acc, c.q_lo, c.q_hi), _rows(lse_acc, c.q_lo, c.q_hi), out, lse, allowed is not None)


def first_step_forward(q: QueryRows, k, v, calls: list[BlockCall], scale: float, backend: str, mask=None,
                       allowed=None, merge=merge_):
    """The local (diagonal) step, which covers every query row exactly once: its
    result initialises the accumulators without a merge. Returns ``(out_acc, lse_acc)``."""
    (whole,) = q.tensors
    b, h, L, d = whole.shape
    ad = acc_dtype(whole.dtype)
    if len(calls) == 1 and calls[0].q_lo == 0 and calls[0].q_hi == L:
        c = calls[0]
        out, lse = block_forward(whole, _rows(k, c.k_lo, c.k_hi), _rows(v, c.k_lo, c.k_hi), c.causal, scale, backend,
                                 _keep(mask, c), _keep(allowed, c))
        return out.to(ad), lse.to(ad)
    out_acc = torch.zeros(b, h, L, v.shape[-1], dtype=ad, device=whole.device)
    lse_acc = torch.full((b, h, L), float("-inf"), dtype=ad, device=whole.device)
    forward_step(q, k, v, calls, out_acc, lse_acc, scale, backend, merge=merge, mask=mask, allowed=allowed)
    return out_acc, lse_acc


def backward_step(rows: QueryRows, k, v, calls: list[BlockCall], dq_acc, scale: float, backend: str, mask=None,
                  allowed=None):
    """Gradients of one ring step: ``rows`` holds this rank's ``dout, q, out, lse`` (the final forward
    result, ``lse`` in the accumulation dtype); adds into ``dq_acc [b, h, L, d]`` and returns
    ``[(call, dk, dv)]`` for the visiting block (added to its travelling dK/dV later,
    once that buffer has arrived). ``mask``, ``allowed``: as :func:`forward_step`'s."""
    grads = []
    for c in calls:
        do, qc, out, lse = rows(c.q_lo, c.q_hi)
        dq, dk, dv = block_backward(do, qc, _rows(k, c.k_lo, c.k_hi), _rows(v, c.k_lo, c.k_hi), out, lse,
                                    c.causal, scale, backend, _keep(mask, c), _keep(allowed, c))
        _rows(dq_acc, c.q_lo, c.q_hi).add_(dq)
        grads.append((c, dk, dv))
    return grads


def add_kv_grads_(dkv: torch.Tensor, grads) -> None:
    """Add a step's ``[(call, dk, dv)]`` into the travelling ``dkv [2, b, h_kv, L, d]``."""
    dk_acc, dv_acc = dkv
    for c, dk, dv in grads:
        _rows(dk_acc, c.k_lo, c.k_hi).add_(dk)
        _rows(dv_acc, c.k_lo, c.k_hi).add_(dv)
