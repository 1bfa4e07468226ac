"""Each rank's bytes from the config alone: a lower bound, torch-free, in microseconds.

``launch`` compares it with the machine before any worker starts (:func:`memory_problems`, called by
``launcher/preflight.check_memory``): a job whose *lower bound* exceeds what the machine has cannot
run, so refusing it never refuses a job that fits. What it counts, per rank (the largest rank holds at
least the average over the ranks, which is what these are):

* **model state** — the dense parameters (the family's count: norms and biases left out; an MoE model's
  routed experts over ``parallel.ep``, each rank holding its share, whole on every rank of a 2D grid) over ``pp·tp``, times the bytes each holds: parameter, gradient and Adam's two moments in the parameters'
  dtype (``4·p``) without hetero — a frozen parameter (``model.lora``'s base) its value only (``1·p``), the
  adapters ``4·p`` —; under hetero what its chunks keep on the host (:func:`hetero_host_bytes`)
  and, on a CPU job, the master state a budget could have put on the device; under a ``deepspeed:``
  section parameters and gradients in at least 16 bits partitioned over ``dp·sp`` (ZeRO-3's least),
  not counted where it offloads (its split between host and device is DeepSpeed's);
* **a checkpoint's save** — under hetero with ``checkpoint.enabled``, the rank's parameters and both Adam
  moments whole, in the parameters' dtype (``3·p``, on every data replica: hetero gathers them from its
  chunks to save them), on the host beside the model state; with 16-bit chunks at one data replica only
  the master rows on the device (the host rows are saved from their live tensors);
* **activations** — what one micro-batch saves for the backward at least, per token of its
  ``[b/(dp·q)/m, s/sp]`` and over ``q``: each block's input ``h`` (all activation checkpointing keeps)
  and, without checkpointing, the inputs of the attention's output projection ``a·d`` and of the MLP's
  last matrix (its width), which their weight gradients need; and the loss's logits ``V`` (padded to a
  multiple of ``q``). In 16 bits
  under autocast, else the parameters' dtype, over the ``pp`` ranks (every micro-batch in flight
  after the first, every other saved tensor left out);
* **the batch** — every rank builds the whole global batch's tokens and targets on the host, int64
  ``[data.batch_size, seq_len]`` each.

Not counted: the process itself (torch, the CUDA context), the allocator, kernels' workspaces,
communication buffers. ``parallel4d plan`` dry-runs the job for the whole figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from parallel4d.config.checks import dense_parameters
from parallel4d.config.rules import hetero as hetero_rules
from parallel4d.config.rules.common import DTYPE_BYTES, human_bytes
from parallel4d.config.rules.lora import adapter_parameters
from parallel4d.config.rules.tensor2d import padded_vocab
from parallel4d.models.moe.spec import MoeShape, expert_parameters

if TYPE_CHECKING:  # annotations only: the schema imports the rules this module imports
    from parallel4d.config.schema import Config

TOKEN_BYTES = 8  # int64 token ids


@dataclass(frozen=True)
class RankBytes:
    """A lower bound of what one rank holds (bytes), by part; ``*_device`` on the compute device, the
    rest on the host. Where the compute device is the CPU, :meth:`host` counts them all."""

    model_state_device: int  # parameters, gradients, optimizer state on the compute device
    model_state_host: int  # hetero's chunk backings and the master state its budget leaves on the host
    activations: int  # on the compute device
    batch: int  # the global batch's tokens and targets, on the host
    master_placed: int = 0  # hetero's master state a budget may place on the compute device (host on a CPU)
    checkpoint: int = 0  # what hetero gathers on the host to save a checkpoint

    def host(self, on_cpu: bool) -> int:
        on_device = self.model_state_device + self.activations + self.master_placed
        return self.batch + self.model_state_host + self.checkpoint + (on_device if on_cpu else 0)

    def device(self) -> int:
        return self.model_state_device + self.activations


def rank_bytes(cfg: Config) -> RankBytes:
    """What every rank of ``cfg`` holds at least, on average over the ranks (see the module)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    experts = expert_parameters(MoeShape.of(m), m.hidden, m.layers)  # split over ep, whole on every grid rank
    params = (dense_parameters(m) - experts) // (p.pp * p.tp) + experts // (p.ep * p.pp)
    dense_adapters, expert_adapters = adapter_parameters(m)  # model.lora: the base (params) frozen, these trained
    adapters = dense_adapters // (p.pp * p.tp) + expert_adapters // (p.ep * p.pp)  # the experts' split as they are
    frozen = params if m.lora is not None else 0
    params += adapters
    item = DTYPE_BYTES[t.parameters]
    replicas = p.dp * p.sp
    device = host = placed = saved = 0
    if cfg.deepspeed is not None:
        device = 0 if _offloads(cfg.deepspeed) else 4 * params // replicas
    elif cfg.hetero.enabled:
        # ZeRO's window: the dense rows over the dp·sp replicas, a rank's E/ep experts over their dp·sp/ep
        # replicas — every parameter of the model over dp·sp alike
        host, placed = hetero_host_bytes(cfg, dense_parameters(m) // (p.pp * p.tp) + adapters, frozen)
        saved = hetero_save_bytes(cfg, params, placed, frozen) if cfg.checkpoint.enabled else 0
    else:
        device = 4 * item * (params - frozen) + item * frozen
    return RankBytes(device, host, _activations(cfg), 2 * TOKEN_BYTES * cfg.data.batch_size * m.seq_len, placed,
                     saved)


def hetero_host_bytes(cfg: Config, params: int, frozen: int = 0) -> tuple[int, int]:
    """``(on the host, placed)``: what hetero's chunks keep in host memory for a rank at least, and the
    master state its budget may put on the compute device instead; ``params``: the parameters of the rank's
    pp·tp share of the model, every expert counted (under ``parallel.ep`` a rank's experts are sharded over
    their replicas only: ``1/ep`` of the experts over ``1/ep`` of the data replicas); ``frozen``: how many of
    them are frozen (``model.lora``'s base), held in the chunks' dtype alone (``citem``: no gradient, no
    master, no moments).

    The rule of hetero/populate.py and hetero/budget.py, per parameter of the rank's ZeRO window
    (``/ (dp·sp)``): with chunks in the parameters' dtype, every chunk's host backing — parameter,
    gradient and both Adam moments (``4·item``); with 16-bit chunks over a wider master, the gradient's
    backing in the chunks' dtype (``citem``) and the master parameters and moments (``3·item``), of which
    the device takes whole rows as long as its budget lasts (``hetero.device_budget_bytes``, static or
    dynamic; every row without a budget). The chunks' padding and the device's arena are left out."""
    item = DTYPE_BYTES[cfg.train.parameters]
    chunk = DTYPE_BYTES[hetero_rules.compute_dtype(cfg)]
    replicas = cfg.parallel.dp * cfg.parallel.sp
    window, still = (params - frozen) // replicas, chunk * frozen // replicas
    if chunk == item:
        return 4 * item * window + still, 0
    master = 3 * item * window
    budget = cfg.hetero.device_budget_bytes
    placed = master if budget is None else min(master, budget)
    return chunk * window + master - placed + still, placed


def hetero_save_bytes(cfg: Config, params: int, placed: int, frozen: int = 0) -> int:
    """What a checkpoint's save gathers on the host beside hetero's own memory: the rank's parameters and
    both Adam moments whole in the parameters' dtype (``3·item``; under ZeRO every data replica gathers
    them), except with 16-bit chunks at one replica, where the host master is saved from its live tensors
    and only the rows ``placed`` on the device are copied (hetero/state.py); the ``frozen`` parameters
    (no moments) are copied out of their chunks, widened to the parameters' dtype."""
    item = DTYPE_BYTES[cfg.train.parameters]
    mixed = DTYPE_BYTES[hetero_rules.compute_dtype(cfg)] != item
    if mixed and cfg.parallel.dp * cfg.parallel.sp == 1:
        return placed + item * frozen
    return 3 * item * params - 2 * item * frozen


def _activations(cfg: Config) -> int:
    """One micro-batch's block inputs and logits, over the pp ranks (see the module)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    rows = cfg.data.batch_size // (p.dp * p.q * cfg.pipeline.microbatches)
    tokens = rows * (m.seq_len // p.sp)
    item = 2 if t.autocast != "none" else DTYPE_BYTES[t.parameters]
    if cfg.hetero.enabled and cfg.hetero.compute_dtype:
        item = min(item, DTYPE_BYTES[cfg.hetero.compute_dtype])
    per_block = m.hidden if t.activation_checkpointing == "blocks" else \
        m.hidden + m.heads * m.head_size + m.mlp_width
    logits = padded_vocab(m.vocab_size, p.q)  # the head's [b/q, s, Vp/q]: the vocabulary padded to the grid
    return tokens * (m.layers * per_block + logits) // p.q * item // p.pp


def _offloads(section: dict) -> bool:
    """Whether a ds_config moves parameters or optimizer state off the device."""
    zero = section.get("zero_optimization")
    return isinstance(zero, dict) and any(isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none"
                                          for k in ("offload_optimizer", "offload_param"))


# --- against the machine ----------------------------------------------------------------------


def memory_problems(cfg: Config, local_ranks: int, device_type: str, host_available: tuple[int, str] | None,
                    gpu_bytes: int | None) -> list[str]:
    """One line for each memory the job cannot fit, naming the figures and the fields to change.

    ``local_ranks``: the ranks on this machine; ``device_type``: the mesh's (``"cpu"`` or ``"cuda"``);
    ``host_available``: ``(bytes, what they are)`` or None where unknown; ``gpu_bytes``: each rank's GPU
    (None: no GPU, or unknown). Empty when the lower bound (:func:`rank_bytes`) fits."""
    # hetero.compute_device=cpu computes on the host whatever the mesh (without ZeRO: config/rules/hetero.py)
    on_cpu = device_type == "cpu" or (cfg.hetero.enabled and cfg.hetero.compute_device == "cpu")
    need, out = rank_bytes(cfg), []
    if gpu_bytes is not None and not on_cpu and need.device() > gpu_bytes:
        out.append(f"each rank needs at least {human_bytes(need.device())} of GPU memory ({_parts(need, False)}) "
                   f"and its GPU has {human_bytes(gpu_bytes)}; {_fixes(cfg, need, False)}")
    host = need.host(on_cpu) * local_ranks
    if host_available is not None and host > host_available[0]:
        ranks = f"{local_ranks} ranks × {human_bytes(need.host(on_cpu))}" if local_ranks > 1 else "its one rank"
        out.append(f"the job needs at least {human_bytes(host)} of host memory on this machine ({ranks}: "
                   f"{_parts(need, on_cpu, host=True)}) and {human_bytes(host_available[0])} is available "
                   f"({host_available[1]}); {_fixes(cfg, need, on_cpu, host=True)}")
    return out


def _held(need: RankBytes, on_cpu: bool, host: bool = False) -> dict[str, int]:
    """The parts that count in one memory: the host's (``host``) or the compute device's."""
    on_device = not host or on_cpu
    return {"activations": need.activations if on_device else 0,
            "model state": (need.model_state_device if on_device else 0)
            + (need.model_state_host + (need.master_placed if on_cpu else 0) if host else 0),
            "checkpoint": need.checkpoint if host else 0,
            "batch": need.batch if host else 0}


_PART_NAMES = {"activations": "activations", "model state": "parameters, gradients and optimizer state",
               "checkpoint": "a checkpoint's gathered parameters and Adam moments",
               "batch": "the batch's tokens and targets"}


def _parts(need: RankBytes, on_cpu: bool, host: bool = False) -> str:
    held = sorted(_held(need, on_cpu, host).items(), key=lambda kv: -kv[1])
    return ", ".join(f"{_PART_NAMES[k]} {human_bytes(v)}" for k, v in held if v)


def _fixes(cfg: Config, need: RankBytes, on_cpu: bool, host: bool = False) -> str:
    """What lowers the largest part, in the fields a user sets (their values now in brackets)."""
    held = _held(need, on_cpu, host)
    largest = max(held, key=held.get)
    p, m, d = cfg.parallel, cfg.model, cfg.data
    if largest == "checkpoint":
        fix = (f"lower model.hidden ({m.hidden}), model.layers ({m.layers}) or model.vocab_size ({m.vocab_size}), "
               f"raise parallel.pp ({p.pp}) or parallel.tp ({p.tp}) (each rank saves a share), or set "
               "checkpoint.enabled=false")
    elif largest == "model state":
        fix = f"lower model.hidden ({m.hidden}), model.layers ({m.layers}) or model.vocab_size ({m.vocab_size})"
        if not host:
            offload = ("deepspeed.zero_optimization.offload_optimizer (DeepSpeed's optimizer state on the host)"
                       if cfg.deepspeed is not None else "hetero.enabled=true (the optimizer state on the host)")
            fix += f", set {offload}, or raise parallel.pp ({p.pp}) or parallel.tp ({p.tp}): each GPU holds a share"
    else:
        fix = f"lower data.batch_size ({d.batch_size}) or model.seq_len ({m.seq_len})"
        if largest == "activations":
            fix += f", or raise pipeline.microbatches ({cfg.pipeline.microbatches}): fewer sequences at a time"
            if not host:
                fix += f", or parallel.dp ({p.dp}), parallel.sp ({p.sp}) or parallel.tp ({p.tp}): more GPUs share them"
    return fix + ". `parallel4d plan` shows each rank's whole figure"
