"""FP8 training, its foundation (#50.1, .2): rowwise-scaled e4m3 products (parallel4d/fp8/) pinned against a
float64 reference that multiplies the same quantized operands, the FP8 linear's three products and gradients,
torchao's ``Float8Linear`` under its ``rowwise`` recipe where torchao is installed, ``train.fp8``'s refusals,
and a one-process training run in FP8 against the same run in bfloat16.

The float64 reference sees exactly what the FP8 product sees (each operand rounded to e4m3 with the same
power-of-two scales, scaled back exactly): what remains is the float32 accumulation's rounding, at most
``K · 2⁻²⁴ · Σ|a·b|`` per element, plus the rounding of the result to its dtype (bfloat16: 2⁻⁸ relative).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from parallel4d.config.errors import ConfigError
from parallel4d.config.load import make_config
from parallel4d.fp8.linear import RowwiseLinear, rowwise_linear
from parallel4d.fp8.rowwise import E4M3_MAX, dequantized, device_problem, rowwise_mm, scales

#: e4m3's unit roundoff: 3 mantissa bits, a rounded element within 2⁻⁴ of its value (relative)
E4M3_U = 2.0 ** -4
#: float32's and bfloat16's unit roundoff
F32_U, BF16_U = 2.0 ** -24, 2.0 ** -8


def _matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    """``[rows, cols]`` spanning magnitudes: rows of very different sizes, one outlier per row (a scale set by
    one element), row 1 and column 2 zero (a row's and a column's amax floored)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    t[torch.arange(rows), torch.randint(0, cols, (rows,), generator=g)] *= 50
    t[1], t[:, 2] = 0, 0
    return t


def assert_within_accumulation(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out`` = the float64 product of ``a`` and ``b`` as e4m3 sees them (rows of ``a``, columns of ``b``
    scaled), to float32 accumulation over K and the rounding to ``out``'s dtype."""
    qa, qb = dequantized(a, 1), dequantized(b, 0)
    want, size = qa @ qb, qa.abs() @ qb.abs()
    u_out = {torch.float32: 0.0, torch.bfloat16: BF16_U}[out.dtype]
    bound = a.shape[1] * F32_U * size + u_out * want.abs() + 1e-300
    err = (out.double() - want).abs()
    assert (err <= bound).all(), f"worst error / bound {float((err / bound).max()):.3g}"


def test_scales_are_the_largest_power_of_two_that_keeps_each_row_within_448():
    """torchao's rowwise scale: 448 / amax rounded down to a power of two, per row (``dim=1``) or per column
    (``dim=0``), float32: the row's largest magnitude lands in (224, 448]; a zero row gets a finite scale."""
    a = _matrix(16, 32, seed=0)
    for dim in (1, 0):
        s = scales(a, dim)
        assert s.dtype == torch.float32 and s.shape == ((16, 1) if dim else (1, 32))
        assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # powers of two
        amax = a.abs().amax(dim=dim, keepdim=True).double()
        live = amax > 0
        assert (amax * s <= E4M3_MAX)[live].all() and (2 * amax * s > E4M3_MAX)[live].all()
    assert torch.isfinite(scales(a, 1)[1]).all() and scales(a, 1)[1].item() == 2.0 ** math.floor(math.log2(448e12))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("product", ["y = x·Wᵀ", "dX = dY·W", "dW = dYᵀ·X"])
def test_each_fp8_product_equals_the_quantized_operands_multiplied_in_float64(product, out_dtype):
    """Each of a linear's three products, its operands laid out as the linear passes them (a transpose's view
    where it takes one), equals the float64 reference to float32 accumulation; and it is a product of
    quantized operands: it differs from the unquantized product by far more than accumulation could."""
    tokens, inp, outp = 48, 64, 32
    x, w, dy = _matrix(tokens, inp, seed=1), _matrix(outp, inp, seed=2), _matrix(tokens, outp, seed=3)
    a, b = {"y = x·Wᵀ": (x, w.t()), "dX = dY·W": (dy, w), "dW = dYᵀ·X": (dy.t(), x)}[product]
    out = rowwise_mm(a, b, out_dtype)
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[1])
    assert_within_accumulation(out, a, b)
    exact = a.double() @ b.double()
    assert ((out.double() - exact).abs() > 1e3 * a.shape[1] * F32_U * (a.abs() @ b.abs()).double()).any()


def _count_scaled_mm(monkeypatch) -> list:
    """Every ``torch._scaled_mm`` call from here on appends its operands' dtypes to the returned list."""
    calls, real = [], torch._scaled_mm

    def counted(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def test_fp8_linear_forward_and_both_gradients_are_the_reference_products(monkeypatch):
    """:class:`RowwiseLinear` (x ``[2, 24, 64]``, W ``[32, 64]``, a bias): y, dX and dW are each an e4m3 product
    of its operands scaled along what it contracts (the float64 reference, to float32 accumulation), the bias
    and its gradient as in ``nn.Linear``; three ``_scaled_mm`` calls on e4m3 operands, none other."""
    calls = _count_scaled_mm(monkeypatch)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    fp8 = RowwiseLinear.of(linear)
    assert fp8.weight is linear.weight and fp8.bias is linear.bias
    x = (torch.randn(2, 24, 64) * torch.logspace(-2, 2, 24).unsqueeze(1)).requires_grad_()
    dy = torch.randn(2, 24, 32)
    y = fp8(x)
    y.backward(dy)
    rows, drows, w = x.detach().reshape(-1, 64), dy.reshape(-1, 32), linear.weight.detach()
    assert_within_accumulation((y - linear.bias).detach().reshape(-1, 32), rows, w.t())
    assert_within_accumulation(x.grad.reshape(-1, 64), drows, w)
    assert_within_accumulation(linear.weight.grad, drows.t(), rows)
    torch.testing.assert_close(linear.bias.grad, dy.sum((0, 1)))
    assert calls == [(torch.float8_e4m3fn, torch.float8_e4m3fn)] * 3


def test_under_bfloat16_autocast_the_fp8_linear_computes_in_bfloat16_and_keeps_float32_gradients():
    """Under autocast the input is cast to bfloat16 (as ``F.linear`` would be): y in bfloat16, the float32
    input's and weight's gradients in float32, each the reference product of the bfloat16 operands."""
    torch.manual_seed(1)
    w = torch.randn(32, 64, requires_grad=True)
    x = torch.randn(40, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = rowwise_linear(x, w)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(40, 32, dtype=torch.bfloat16)
    y.backward(dy)
    assert x.grad.dtype == w.grad.dtype == torch.float32
    xb = x.detach().bfloat16()
    assert_within_accumulation(y.detach(), xb, w.detach().t())
    assert_within_accumulation(x.grad.bfloat16(), dy, w.detach())
    assert_within_accumulation(w.grad.bfloat16(), dy.t(), xb)


def test_fp8_linear_equals_torchao_float8_linear_under_its_rowwise_recipe():
    """torchao's ``Float8Linear`` (``Float8LinearConfig.from_recipe_name("rowwise")``: e4m3 everywhere, axiswise
    scales rounded down to powers of two) on the CPU, bfloat16 input and weight: the output and both gradients
    equal ours bit for bit (its gradient products unscale after a unit-scale ``_scaled_mm``; with
    power-of-two scales that is exact)."""
    float8 = pytest.importorskip("torchao.float8", reason="torchao is the fp8 extra: pip install 'parallel4d[fp8]'")
    torch.manual_seed(2)
    base = torch.nn.Linear(64, 48, bias=False).bfloat16()
    theirs = torch.nn.Sequential(base)  # its public swap: every nn.Linear inside a module, parameters shared
    float8.convert_to_float8_training(theirs, config=float8.Float8LinearConfig.from_recipe_name("rowwise"))
    assert type(theirs[0]).__name__ == "Float8Linear" and theirs[0].weight is base.weight
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16) * torch.logspace(-2, 2, 16, dtype=torch.bfloat16).unsqueeze(1)
    dy = torch.randn(3, 16, 48, dtype=torch.bfloat16)
    results = []
    for module in (theirs, RowwiseLinear.of(base)):
        xi = x.clone().requires_grad_()
        base.weight.grad = None
        y = module(xi)
        y.backward(dy)
        results.append((y.detach(), xi.grad, base.weight.grad.clone()))
    for name, t, o in zip(("y", "dX", "dW"), *results):
        assert torch.equal(t, o), f"{name}: worst difference {float((t.float() - o.float()).abs().max())}"


def _two_ranks_group():
    """A fake group of two ranks in this process (threads): ``sync_of(rank)`` is rank's
    :data:`~parallel4d.fp8.rowwise.AmaxSync`, the elementwise MAX of both ranks' amaxes (what the engine's
    all-reduce computes); ``calls`` the shapes and dtypes each call got."""
    barrier, posted, calls = threading.Barrier(2), {}, []

    def sync_of(rank):
        def sync(largest):
            calls.append((rank, tuple(largest.shape), largest.dtype))
            posted[rank] = largest.clone()
            barrier.wait()
            reduced = torch.maximum(posted[0], posted[1])
            barrier.wait()  # both read before either posts again
            return largest.copy_(reduced)
        return sync
    return sync_of, calls


def _halves_backward(weight, x, dy, sync_of) -> list[torch.Tensor]:
    """Each half of the tokens (dim 1 of ``x`` / ``dy`` ``[b, T, ·]``: a sequence shard each) through its own
    :class:`RowwiseLinear` over a copy of ``weight``, in two threads (two ranks): each half's dW."""
    half, grads = x.shape[1] // 2, [None, None]

    def rank(r):
        w = torch.nn.Parameter(weight.detach().clone())
        layer = RowwiseLinear.of(torch.nn.Linear(1, 1, bias=False), None if sync_of is None else sync_of(r))
        layer.weight, tokens = w, slice(r * half, (r + 1) * half)
        layer(x[:, tokens].clone().requires_grad_()).backward(dy[:, tokens])
        grads[r] = w.grad
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return grads


def test_the_token_amax_reduction_makes_two_half_batches_weight_gradients_the_whole_batchs():
    """dW = dYᵀ·X contracts over the tokens, which data replicas and sequence shards split: two ranks
    holding half the tokens each, their amaxes MAX-reduced (one call each per backward, on ``[1, out + in]``
    float64), sum to the whole batch's FP8 dW (the float64 reference with the whole batch's scales, to float32
    accumulation). Without the reduction each half scales its tokens alone and the sum is another product.

    The halves are far apart in size (X 2⁻¹⁶ smaller on the second, dY on the first): under the whole batch's
    scales the small ones fall below e4m3's normal range (2⁻⁶ of a scaled 448) and round coarsely, while a half
    scaled alone keeps them — e4m3 is a floating-point format, so a power-of-two scale changes a product only
    through the values it pushes below the normal range or saturates."""
    torch.manual_seed(3)
    tokens, inp, outp = 32, 64, 48
    small = torch.cat([torch.ones(tokens // 2), torch.full((tokens // 2,), 2.0 ** -16)]).view(1, tokens, 1)
    x, dy = torch.randn(2, tokens, inp) * small, torch.randn(2, tokens, outp) * small.flip(1)
    weight = torch.randn(outp, inp)
    sync_of, calls = _two_ranks_group()
    together = sum(_halves_backward(weight, x, dy, sync_of))
    assert sorted(calls) == [(r, (1, outp + inp), torch.float64) for r in (0, 1)]
    assert_within_accumulation(together, dy.reshape(-1, outp).t(), x.reshape(-1, inp))
    alone = sum(_halves_backward(weight, x, dy, None))
    exact = (dy.reshape(-1, outp).t().double() @ x.reshape(-1, inp).double())
    assert (together.double() - alone.double()).abs().max() > 1e-3 * exact.abs().max()


def test_a_split_backward_computes_each_fp8_product_once(monkeypatch):
    """Zero-bubble's split backward (pipeline/split_grad.py) through two FP8 linears: B computes the input
    gradients alone (one dX product per linear, no amax reduction), W the weight gradients alone (one dW
    product and one reduction per linear); the gradients are those of one whole backward, bit for bit."""
    from parallel4d.pipeline.split_grad import input_gradient

    torch.manual_seed(4)
    reductions = []

    def sync(largest):
        reductions.append(largest.shape)
        return largest
    layers = [RowwiseLinear.of(torch.nn.Linear(32, 32, bias=False), sync) for _ in range(2)]
    x, dy = torch.randn(3, 8, 32), torch.randn(3, 8, 32)

    def forward(inp):
        return layers[1](torch.relu(layers[0](inp)))
    xw = x.clone().requires_grad_()
    forward(xw).backward(dy)
    want = [xw.grad] + [layer.weight.grad.clone() for layer in layers]
    for layer in layers:
        layer.weight.grad = None
    xs = x.clone().requires_grad_()
    y = forward(xs)
    calls = _count_scaled_mm(monkeypatch)
    reductions.clear()
    (dx,), weights = input_gradient([y], [dy], [xs])
    assert len(calls) == 2 and not reductions, "B: one dX product per linear, nothing else"
    assert all(layer.weight.grad is None for layer in layers)
    weights.run()
    assert len(calls) == 4 and len(reductions) == 2, "W: one dW product and one reduction per linear"
    for name, got, w in zip(("dX", "dW 0", "dW 1"), [dx] + [layer.weight.grad for layer in layers], want):
        assert torch.equal(got, w), name


def _fp8_job(**train) -> dict:
    return {"model": {"arch": "llama", "hidden": 64, "heads": 4}, "train": {"dtype": "bfloat16", "fp8": "rowwise",
                                                                           **train}}


@pytest.mark.parametrize("sections, words", [
    ({"train": {"dtype": "float64"}}, ["train.fp8=rowwise with train.dtype=float64", "never", "train.fp8=none"]),
    ({"train": {"dtype": "float32", "param_dtype": "float64"}}, ["train.param_dtype=float64", "never"]),
    ({"deepspeed": {"zero_optimization": {"stage": 1}}}, ["not with a deepspeed: section", "remove it"]),
    ({"model": {"lora": {"rank": 2, "alpha": 4, "targets": ["q_proj"]}}}, ["not with model.lora", "remove model.lora"]),
    ({"model": {"num_experts": 4, "num_experts_per_tok": 2}}, ["not with model.num_experts=4", "model.num_experts=0"]),
])
def test_fp8_where_it_does_not_run_is_refused_naming_the_field_and_fix(sections, words):
    """Each layout FP8 linears do not run in yet is refused by name with its fix ("for now" and train.fp8=none);
    float64 parameters never."""
    job = _fp8_job()
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) and key != "deepspeed" else value
    with pytest.raises(ConfigError) as e:
        make_config(job)
    message = str(e.value)
    assert all(w in message for w in words), message
    if "never" not in words:
        assert "runs on a dense model only for now" in message and "or train.fp8=none" in message


def test_fp8_is_off_by_default_and_accepted_in_one_process_with_float32_or_bfloat16():
    assert make_config({}).train.fp8 == "none"
    for dtype in ("float32", "bfloat16"):
        assert make_config(_fp8_job(dtype=dtype)).train.fp8 == "rowwise"


@pytest.mark.parametrize("sections", [
    {"parallel": {"dp": 2, "sp": 2}},
    {"parallel": {"dp": 2, "sp": 2}, "sequence": {"ulysses": 2}},
    {"parallel": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "zb_h1", "microbatches": 2}},
    {"parallel": {"dp": 2}, "hetero": {"enabled": True}},
    {"hetero": {"enabled": True}},
])
def test_fp8_is_accepted_over_the_data_sequence_and_pipeline_axes_and_hetero(sections):
    """The layouts whose FP8 products equal one process's (tests/test_expert_parallel.py trains each)."""
    assert make_config({**_fp8_job(), **sections}).train.fp8 == "rowwise"


def test_fp8_is_accepted_under_2d_tensor_parallelism():
    """``parallel.tp`` runs FP8 (the blocks' SUMMA products and panels: tests/test_tensor2d_ops.py,
    tests/test_expert_parallel.py)."""
    job = {**_fp8_job(), "parallel": {"tp": 4}}
    assert make_config(job).parallel.tp == 4

def test_a_gpu_without_fp8_products_is_refused_naming_it_and_the_fix(monkeypatch):
    """compose() refuses ``train.fp8`` on a GPU below compute capability 8.9 (no FP8 tensor cores: ``_scaled_mm``
    fails there) with the GPU's name and capability; 8.9 and later, and the CPU, run it. (CUDA's answers are
    faked: no GPU is asked.)"""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    for capability, refused in (((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        problem = device_problem(torch.device("cuda", 0))
        assert (problem is not None) == refused, (capability, problem)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    message = device_problem(torch.device("cuda", 0))
    assert all(w in message for w in ("NVIDIA A100-SXM4-80GB", "compute capability 8.0", "8.9 or later",
                                      "set train.fp8=none")), message
    assert device_problem(torch.device("cpu")) is None


#: how many steps the FP8 run is compared over
STEPS = 12


def test_fp8_training_stays_within_e4m3_precision_of_bfloat16_training(single_rank, monkeypatch):
    """``train.fp8: rowwise`` through compose() in one process (a 4-layer llama, bfloat16 autocast, two
    micro-batches): every step's loss is within ``2⁻⁴ · loss`` of the same job without FP8, over 12 steps.

    Why 2⁻⁴ (e4m3's unit roundoff u, not a fitted number): each element of an FP8 operand is within u of its
    value, so a product term a·b within about 2u, and a linear's output within 2u of Σ|a·b| at worst. Those
    roundings are unbiased and independent over the K terms, the tokens and the 28 linears, and the loss is a
    mean over 128 tokens of a log-softmax: it moves by a small fraction of one term's worst error, so a band
    of u on the loss holds the first step with a margin, and leaves room for the parameters to drift apart over
    the steps (every gradient within ~2u as well, and AdamW's updates normalised). The bfloat16 run must fall
    by more than twice the band over the steps, so a run that learned nothing could not pass; and every linear
    of the blocks, none else, computes in FP8: 3 ``_scaled_mm`` calls (y, dX, dW) per linear per micro-batch."""
    from test_llama import BASE, _job, train_layouts

    train = {**BASE["train"], "steps": STEPS, "dtype": "bfloat16"}
    bf16 = _job({}, {"microbatches": 2}, train=train)
    fp8 = _job({}, {"microbatches": 2}, train={**train, "fp8": "rowwise"})
    want, want_pieces = train_layouts({"bf16": bf16})["bf16"]
    calls = _count_scaled_mm(monkeypatch)
    losses, pieces = train_layouts({"fp8": fp8})["fp8"]
    layers = BASE["model"]["layers"]
    assert len(calls) == 3 * 7 * layers * 2 * STEPS  # q, k, v, o, gate, up, down in each block
    assert set(pieces) == set(want_pieces)  # the same parameters, under the same names
    want, losses = torch.tensor(want), torch.tensor(losses)
    assert want[0] - want[-1] > 2 * E4M3_U * want[0], f"bfloat16 fell from {want[0]:.3f} to {want[-1]:.3f} only"
    worst = ((losses - want).abs() / want).max()
    assert worst <= E4M3_U, f"FP8 losses {losses.tolist()} against bfloat16's {want.tolist()}: worst {worst:.3g}"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_padding_to_multiples_of_16_leaves_each_product_unchanged(monkeypatch, out_dtype):
    """CUDA's ``_scaled_mm`` wants M, K and N multiples of 16: ``scaled_mm`` pads the quantized operands with
    zeros and slices the result (``pad_to=16`` forces on the CPU what a GPU does by default). ``_scaled_mm``
    then sees 48×32 by 32×32 operands for a 40×24 by 24×20 product, and the product equals the unpadded one
    bit for bit (zeros add nothing to a sum; the scales come from the unpadded operands). Without ``pad_to``
    the CPU pads nothing."""
    from parallel4d.fp8.rowwise import quantize, scaled_mm

    shapes, real = [], torch._scaled_mm

    def recorded(a, b, *args, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape), tuple(kwargs["scale_a"].shape), tuple(kwargs["scale_b"].shape)))
        return real(a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    a, b = _matrix(40, 24, seed=4), _matrix(20, 24, seed=5).t()  # b a transpose's view, as the forward passes W
    sa, sb = scales(a, 1), scales(b, 0)
    a8, b8 = quantize(a, sa), quantize(b, sb)
    unpadded = scaled_mm(a8, b8, sa, sb, out_dtype)
    padded = scaled_mm(a8, b8, sa, sb, out_dtype, pad_to=16)
    assert shapes == [((40, 24), (24, 20), (40, 1), (1, 20)), ((48, 32), (32, 32), (48, 1), (1, 32))]
    assert padded.shape == (40, 20) and padded.dtype == out_dtype and padded.is_contiguous()
    assert torch.equal(padded, unpadded)
    assert_within_accumulation(padded, a, b)


def test_fp8_under_hetero_in_one_process_trains_as_the_dense_model_without_a_collective(single_rank):
    """Hetero without ZeRO (one data replica: chunks under a device budget below the model, nothing sharded):
    the FP8 linears over hetero's placed parameters train as the dense model in FP8 — losses within 1e-6
    (relative) over 4 steps, every parameter within float32's reordering (1e-5) — and, with every micro-batch
    whole on the rank, no amax is reduced (no ``fp8.amax`` collective)."""
    from test_expert_parallel import _fp8_job as dense_fp8_job, _fp8_one_process, fp8_held
    from test_llama import train_layouts

    job = dense_fp8_job({}, hetero={"enabled": True, "chunk_elems": 2048, "device_budget_bytes": 60_000})
    got = train_layouts({"hetero": job}, inspect=fp8_held)
    want_losses, want = _fp8_one_process(1, False)
    losses, pieces = got["hetero"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-6, atol=0)
    for dense, boxes in pieces.items():
        for off, t in boxes:
            torch.testing.assert_close(t, want[dense][tuple(slice(o, o + n) for o, n in zip(off, t.shape))],
                                       rtol=0, atol=1e-5, msg=lambda m, d=dense: f"{d}: {m}")
    held = got[("inspect", "hetero")]
    assert held["linears"] == 7 * 3 and held["synced"] == 0 and held["amax all-reduces"] == 0, held
    assert held["bytes moved"] > 0, held
