"""Where this rank's trainable state lives, behind one interface: :class:`ParameterStore`.

The :class:`~parallel4d.engine.step.Engine` asks its store, never which kind it has, to reduce
the gradients over the data replicas, measure their norm, scale them before the update, account
for the memory they take and move the state in and out of checkpoints. :func:`parameter_store`
picks the kind once, from ``hetero.enabled``:

* :class:`PlainStore`: ``nn.Parameter`` s whose ``.grad`` holds the gradient, any torch optimizer
  (AdamW, fused or apex's); the gradients are averaged over the data replicas ``dp × sp`` by
  :class:`~parallel4d.distributed.ddp.GradBuckets` while the backward runs.
* :class:`HeteroStore`: hetero's chunks hold parameters, gradients and optimizer state (a device
  arena backed by host memory; ``p.grad`` stays None); its ZeRO reduces the gradients over the
  data replicas (:class:`DataReplicas`) and its optimizer updates chunk by chunk. Under expert
  parallelism the experts' slices get rows of their own, sharded and reduced over the expert replicas
  (hetero's ``partial_replicas``); their squared norms, summed over every data replica, count each expert
  once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from parallel4d.config.rules import hetero as hetero_rules
from parallel4d.config.schema import Config
from parallel4d.distributed.mesh import Mesh
from parallel4d.engine import grads
from parallel4d.engine.experts import ExpertShards, zero_grad_steps
from parallel4d.engine.memory import SavedActivations, adam_state_bytes, optimizer_state_bytes, tensor_bytes
from parallel4d.engine.model import TORCH_DTYPES, LocalModel
from parallel4d.engine.state import LocalState
from parallel4d.hetero import load_state_dict as hetero_load_state_dict
from parallel4d.hetero import state_dict as hetero_state_dict
from parallel4d.hetero import wrap as hetero_wrap
from parallel4d.optim.optimizer import build_optimizer, param_groups


class ParameterStore(ABC):
    """This rank's trainable parameters, their gradients and the optimizer state.

    ``model``: the rank's :class:`~parallel4d.engine.model.LocalModel`; ``optimizer``: what steps
    it (``param_groups``, ``step()``, ``zero_grad()``); ``params``: its trainable parameters;
    ``tied_params``: this rank's copies of a token table tied across two pp ranks (their squared
    norm counts half on each)."""

    def __init__(self, model: nn.Module, optimizer, mesh: Mesh, tied_params: list[nn.Parameter]):
        self.model, self.optimizer, self.mesh = model, optimizer, mesh
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.tied_params = list(tied_params)

    # --- gradients ------------------------------------------------------------------
    @abstractmethod
    def start_gradient_reduction(self) -> None:
        """Before a step's backward: get ready to reduce the gradients over the data replicas."""

    @abstractmethod
    def finish_gradient_reduction(self) -> None:
        """After the backward: the gradients are this rank's share of the global mean loss's
        (or will be at the optimizer step, where the store reduces there)."""

    @abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient, float64 ``[]``, equal on every rank: each dense
        element once (:func:`~parallel4d.engine.grads.norm_weight`), summed over tp and pp."""

    @abstractmethod
    def scale_gradients(self, coef: torch.Tensor) -> None:
        """Multiply the gradients by ``coef`` (float64 ``[]`` on the device) before the next optimizer
        step (unscaling, clipping)."""

    @abstractmethod
    def close(self) -> None:
        """Take the store's hooks off the model's parameters (a hook held by a parameter keeps the
        store, and the groups it reaches, alive in a cycle Python cannot collect)."""

    def skips_on_device(self) -> bool:
        """Whether the optimizer can skip a step on a flag it reads on the device (see :meth:`optimizer_step`)."""
        return False

    def _step(self, overflow: torch.Tensor | None) -> None:
        """The optimizer's step; ``overflow``: only where :meth:`skips_on_device`."""
        self.optimizer.step()

    def optimizer_step(self, coef: torch.Tensor | None, overflow: torch.Tensor | None) -> None:
        """The update: the gradients times ``coef`` (None: as they are), then the optimizer's step,
        skipped where ``overflow`` (float16's flag, agreed by every rank: float32 ``[]``, 1.0 or 0.0) is
        set. An optimizer that :meth:`skips_on_device` gets the flag on the device and the step never
        waits; any other needs it on the host: the one read a float16 step makes (``train.fused=off``
        or ``apex``; hetero, whose optimizer counts its steps on the host)."""
        if overflow is not None and not self.skips_on_device():
            if not is_fake(overflow) and bool(overflow):  # a host read: this optimizer cannot leave a step
                return  # undone on the device (a dry run's flag holds no value: it plans the step taken)
            overflow = None
        if coef is not None:
            self.scale_gradients(coef)
        self._step(overflow)

    # --- memory ---------------------------------------------------------------------
    @abstractmethod
    def measuring(self, meter: SavedActivations) -> AbstractContextManager:
        """A context in which every activation saved for the backward passes through ``meter``."""

    @abstractmethod
    def model_storages(self) -> list[torch.Tensor]:
        """The tensors whose storage is model data, not activation (``meter`` leaves them out)."""

    @abstractmethod
    def gradient_bytes(self) -> int | None:
        """Bytes of the gradients held after the backward; None where they live in the chunks."""

    @abstractmethod
    def held_bytes(self) -> dict[str, int]:
        """What the store holds besides parameters and gradients, by ``memory`` key ({} if nothing)."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int | None:
        """Bytes of the optimizer state after a step; None where it lives in the chunks."""

    @abstractmethod
    def expected_optimizer_state_bytes(self) -> int | None:
        """:meth:`optimizer_state_bytes` computed before any step (``parallel4d plan``'s dry run)."""

    @abstractmethod
    def hetero_stats(self) -> dict | None:
        """hetero's statistics (``summary.json``'s ``hetero``); None for a plain store."""

    # --- checkpoints ----------------------------------------------------------------
    @abstractmethod
    def local_state(self, names) -> LocalState:
        """``(parameters, optimizer state)`` by LocalModel name for ``names`` (tied aliases
        included): what :func:`~parallel4d.engine.state.dense_state_dict` maps to dense names."""

    @abstractmethod
    def load_local_state(self, local: LocalState) -> None:
        """Restore :meth:`local_state`'s ``(parameters, optimizer state)``."""


class PlainStore(ParameterStore):
    """Parameters with ``.grad``, a torch optimizer, gradients averaged in buckets during the
    backward (``grad_sync``: :func:`~parallel4d.engine.grads.gradient_buckets`, None with one
    replica)."""

    def __init__(self, model: nn.Module, optimizer, mesh: Mesh, tied_params: list[nn.Parameter], *,
                 cfg: Config, executor=None, defer_tied: bool = False, experts: ExpertShards | None = None):
        super().__init__(model, optimizer, mesh, tied_params)
        self.experts = experts  # expert parallelism: this rank's expert slices and their groups
        self.grad_sync = grads.gradient_buckets(self.params, mesh, cfg, executor,
                                                deferred=self.tied_params if defer_tied else (), experts=experts)

    def start_gradient_reduction(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.start()

    def close(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.remove()

    def finish_gradient_reduction(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def grad_norm(self) -> torch.Tensor:
        return grads.global_grad_norm(self.params, self.mesh, {id(p) for p in self.tied_params}, self.experts)

    def scale_gradients(self, coef: torch.Tensor) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)

    def skips_on_device(self) -> bool:
        """torch's fused Adam/AdamW read a ``found_inf`` flag on the device (as ``GradScaler`` hands it
        over) and leave the parameters, moments and step counts as they were where it is 1."""
        return isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW) and \
            all(g.get("fused") for g in self.optimizer.param_groups)

    def _step(self, overflow: torch.Tensor | None) -> None:
        if overflow is None:
            self.optimizer.step()
            return
        self.optimizer.found_inf = overflow
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def measuring(self, meter: SavedActivations) -> AbstractContextManager:
        return nullcontext()  # autograd's saved-tensor hooks (meter's own) see every activation

    def model_storages(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def gradient_bytes(self) -> int | None:
        return tensor_bytes(p.grad for p in self.params)

    def held_bytes(self) -> dict[str, int]:
        return {}

    def optimizer_state_bytes(self) -> int | None:
        return optimizer_state_bytes(self.optimizer)

    def expected_optimizer_state_bytes(self) -> int | None:
        return adam_state_bytes(self.optimizer)

    def hetero_stats(self) -> dict | None:
        return None

    def local_state(self, names) -> LocalState:
        """The live tensors of ``names``; zeros for the optimizer state of a parameter before its first step."""
        params, optim = {}, {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name not in names:  # a LoRA job's frozen base: not in its checkpoints
                continue
            params[name] = p.data
            if p.requires_grad:
                optim[name] = self.optimizer.state.get(p) or {
                    "step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        return params, optim

    def load_local_state(self, local: LocalState) -> None:
        params, optim = local
        for name, p in self.model.named_parameters():
            if name not in params:  # a LoRA job's frozen base: as model.pretrained / train.seed made it
                continue
            with torch.no_grad():
                p.copy_(params[name])
            if p.requires_grad and float(optim[name]["step"]) > 0:
                self.optimizer.state[p] = placed_optimizer_state(self.optimizer, p, optim[name])


def placed_optimizer_state(optimizer, p: nn.Parameter, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``p``'s loaded Adam ``state`` where ``optimizer`` reads it, by torch's own rule for a loaded state
    (``Optimizer.load_state_dict``): the moments on ``p``'s device in its dtype; ``step`` there too,
    as float32, when ``p``'s group is ``fused`` or ``capturable`` (their kernels read it on the device,
    and refuse or sync on a host one), else as loaded (the host: a plain step reads it there)."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    on_device = bool(group.get("fused") or group.get("capturable"))
    placed = {}
    for key, value in state.items():
        if key == "step":
            placed[key] = value.to(device=p.device, dtype=torch.float32) if on_device else value
        else:
            placed[key] = value.to(device=p.device, dtype=p.dtype if value.is_floating_point() else value.dtype)
    return placed


class HeteroStore(ParameterStore):
    """hetero's chunks (``optimizer``: its :class:`~parallel4d.hetero.HeteroOptimizer`, which owns
    the chunks, ZeRO over the data replicas and the statistics)."""

    def start_gradient_reduction(self) -> None:
        pass  # the backward writes the gradients into the chunks; ZeRO reduces them at the step

    def finish_gradient_reduction(self) -> None:
        pass

    def close(self) -> None:
        self.optimizer.remove_hooks()

    def grad_norm(self) -> torch.Tensor:
        tied, q = {id(p) for p in self.tied_params}, self.mesh.size("tp_row")
        weights = {name: grads.norm_weight(p, q, tied) for name, p in self.model.named_parameters()}
        return grads.sum_over_model_axes(self.optimizer.grad_sq_norm(weights), self.mesh).sqrt()

    def scale_gradients(self, coef: torch.Tensor) -> None:
        self.optimizer.scale_next_step(coef)  # the gradients live in the chunks until the step

    @contextmanager
    def measuring(self, meter: SavedActivations):
        self.optimizer.watch_activations(meter)  # its own saved-tensor hooks see the activations
        try:
            yield
        finally:
            self.optimizer.watch_activations(None)

    def model_storages(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + self.optimizer.arenas()

    def gradient_bytes(self) -> int | None:
        return None  # in the chunks: hetero_device, hetero_host

    def held_bytes(self) -> dict[str, int]:
        stats = self.optimizer.stats()
        return {"hetero_device": stats["arena_bytes"], "hetero_host": stats["host_bytes"]}

    def optimizer_state_bytes(self) -> int | None:
        return None  # in the chunks: hetero_host

    def expected_optimizer_state_bytes(self) -> int | None:
        return None

    def hetero_stats(self) -> dict | None:
        return self.optimizer.stats()

    def local_state(self, names) -> LocalState:
        """hetero's gathered copies (collective under ZeRO)."""
        sd = hetero_state_dict(self.model, self.optimizer)
        return {k: v for k, v in sd["model"].items() if k in names}, sd["optim"]["state"]

    def load_local_state(self, local: LocalState) -> None:
        params, optim = local
        hetero_load_state_dict(self.model, self.optimizer, {"model": params, "optim": {"state": optim}},
                               frozen_may_be_missing=True)  # a LoRA checkpoint: adapters only


class DataReplicas:
    """The mesh as hetero's ZeRO sees it: its ``dp`` axis is every data replica
    (``dp × sp``: parameters are replicated over both, and each rank's loss is the
    mean over its own tokens, so gradients are averaged over both)."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.comm_stats, self.device = mesh, mesh.comm_stats, mesh.device
        self.timeout_s, self.deadlines = mesh.timeout_s, mesh.deadlines  # every ZeRO wait's limit
        self._group = mesh.group_over("dp", "sp")

    def _check(self, axis: str) -> None:
        if axis != "dp":
            raise ValueError(f"DataReplicas only answers for the 'dp' axis, not {axis!r}")

    def size(self, axis: str) -> int:
        self._check(axis)
        return self.mesh.size("dp") * self.mesh.size("sp")

    def rank(self, axis: str) -> int:
        self._check(axis)
        return self.mesh.rank_over("dp", "sp")

    def group(self, axis: str):
        self._check(axis)
        return self._group


def parameter_store(cfg: Config, mesh: Mesh, model: LocalModel, executor=None, tied_params=(),
                    tied_sync=None, experts: ExpertShards | None = None) -> ParameterStore:
    """The store ``cfg`` asks for over ``model`` (its optimizer built from ``optimizer.*`` with the
    dense names' parameter groups): hetero's chunks when ``hetero.enabled``, else plain.
    ``tied_sync``: the table tied across two pp ranks is summed between them at the step's end,
    so its data-parallel reduction waits for that. ``experts``: this rank's expert slices under expert
    parallelism (:func:`~.experts.place_experts`), summed over their replicas only."""
    named = model.dense_named_parameters()
    if cfg.hetero.enabled:
        partial = (experts.params, experts.replicas) if experts is not None else None
        model, optimizer = hetero_wrap(model, cfg.optimizer, cfg.hetero, mesh=DataReplicas(mesh),
                                       param_groups=param_groups(named, cfg.optimizer),
                                       compute_dtype=TORCH_DTYPES[hetero_rules.compute_dtype(cfg)],
                                       partial_replicas=partial, zero_grad_steps=zero_grad_steps(model))
        if cfg.train.grad_clip is None and cfg.train.autocast != "float16":
            # nothing scales the gradients after the backward (no clipping, no loss scale): a host row's
            # update can start as soon as its gradient is final
            optimizer.update_in_backward()
        return HeteroStore(model, optimizer, mesh, list(tied_params))
    optimizer = build_optimizer(named, cfg.optimizer, cfg.train.fused)
    return PlainStore(model, optimizer, mesh, list(tied_params), cfg=cfg, executor=executor,
                      defer_tied=tied_sync is not None, experts=experts)
