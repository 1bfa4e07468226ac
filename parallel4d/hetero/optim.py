"""Chunk-wise Adam / AdamW.

The arithmetic is exactly that of ``torch.optim.Adam/AdamW(foreach=False)``
(``_single_tensor_adam``), applied to flat chunk ranges (all tensors of the range
share one step count) or per tensor, so results are bit-identical on CPU. Runs on
the compute device where the chunks are resident (no compiler needed).
"""

from __future__ import annotations

import torch


def adam_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                decoupled: bool) -> None:
    """One Adam(W) update in place on equally shaped ``p, g, m, v`` (``step`` already incremented)."""
    if weight_decay != 0:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_f = float(step)
    bias_correction1 = 1 - beta1 ** step_f
    bias_correction2 = 1 - beta2 ** step_f
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def fused_adam_update(p, g, m, v, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, decoupled: bool) -> None:
    """The same update with torch's fused kernel (one pass; CPU or CUDA). Not bit-identical
    to :func:`adam_update` (different evaluation order), so exactness tests use the latter."""
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    # the step count made where the kernel reads it by a fill, not copied from the host (no wait on CUDA)
    fn([p], [g], [m], [v], [], [torch.full((), float(step), device=p.device)], lr=lr, beta1=beta1, beta2=beta2,
       weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


class HeteroOptimizer(torch.optim.Optimizer):
    """Adam/AdamW over the chunks of a :class:`~parallel4d.hetero.runtime.HeteroRuntime`.

    A ``torch.optim.Optimizer``: ``step()``, ``zero_grad()``, ``param_groups`` (the
    ``groups`` given — ``[{"params": [...], "weight_decay": 0.0}, ...]`` as for torch's
    AdamW, each group's ``lr``, ``betas``, ``eps`` and ``weight_decay`` used for its
    parameters — or one group of every trainable parameter), so torch's ``LRScheduler``s
    drive it; ``state_dict()`` / ``load_state_dict()`` are keyed by parameter name.
    Gradients live in chunks (``p.grad`` stays ``None``); ``step()`` consumes them (they are
    FREE afterwards, so ``zero_grad`` is then a no-op).
    """

    def __init__(self, runtime, cfg, groups: list[dict] | None = None):
        self.rt = runtime
        self.cfg = cfg
        self.decoupled = cfg.name == "adamw"
        trainable = [r.param for r in runtime.records if r.trainable]
        defaults = {"lr": float(cfg.lr), "betas": tuple(cfg.betas), "eps": float(cfg.eps),
                    "weight_decay": float(cfg.weight_decay)}
        super().__init__(groups if groups is not None else [{"params": trainable}], defaults)
        self._names = {id(r.param): r.name for r in runtime.records}
        grouped = [id(p) for g in self.param_groups for p in g["params"]]
        if sorted(grouped) != sorted(id(p) for p in trainable):
            raise ValueError("hetero.wrap: the parameter groups must hold each trainable parameter of the wrapped "
                             "model exactly once")
        self._clip_coef: torch.Tensor | float | None = None

    # --- the training-loop surface ------------------------------------------------
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.rt.optimizer_step(self._hyperparameters(), grad_scale=self._clip_coef)
        self._clip_coef = None
        return loss

    def _hyperparameters(self) -> dict[str, dict]:
        """Per trainable parameter name: its group's ``lr, beta1, beta2, eps, weight_decay, decoupled``."""
        hp_of = {}
        for g in self.param_groups:
            b1, b2 = g["betas"]
            hp = dict(lr=float(g["lr"]), beta1=float(b1), beta2=float(b2), eps=float(g["eps"]),
                      weight_decay=float(g["weight_decay"]), decoupled=self.decoupled)
            hp_of.update((self._names[id(p)], hp) for p in g["params"])
        return hp_of

    def update_in_backward(self, on: bool = True) -> None:
        """Start each host row's update in the backward, as soon as its gradient is final (16-bit chunks,
        dp = 1, after the first step): the update overlaps the rest of the backward as well as the next
        forward. Exact only when the step does not scale the gradients afterwards — no
        :meth:`clip_grad_norm_`, no :meth:`scale_next_step` (``step`` refuses one then) — when the
        hyperparameters in ``param_groups`` during the backward are the step's, and when every step runs
        the micro-batches the first ran (a gradient after its row's update is refused)."""
        self.rt.adam.in_backward = self._hyperparameters if on else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.rt.zero_grad()

    def remove_hooks(self) -> None:
        """Take the runtime's hooks off the model (training and its state-dict view end here)."""
        self.rt.remove_hooks()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradients (over dp under ZeRO), float64 ``[]`` on the compute
        device; the next ``step()`` scales them by ``min(1, max_norm/(norm+1e-6))`` like
        ``torch.nn.utils.clip_grad_norm_``, the coefficient staying on the device (nothing here waits
        for it). The norm of this model's parameters only: a model split over more ranks (tensor or
        pipeline parallel) sums :meth:`grad_sq_norm` over them and calls :meth:`scale_next_step`."""
        norm = self.rt.grad_sq_norm().sqrt()
        self.scale_next_step((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def grad_sq_norm(self, weights: dict[str, float] | None = None) -> torch.Tensor:
        """Σ weight · ‖grad‖² over this model's parameters and the data replicas, float64 ``[]``
        (``weights`` by parameter name, default 1)."""
        return self.rt.grad_sq_norm(weights)

    def scale_next_step(self, coef: torch.Tensor | float) -> None:
        """Multiply the gradients by ``coef`` (a number, or ``[]`` on the compute device) in the next
        ``step()`` (clipping, unscaling)."""
        self._clip_coef = coef

    # --- inspection -------------------------------------------------------------------
    def gradients(self) -> dict[str, torch.Tensor]:
        """Full gradients by parameter name (CPU copies; collective under ZeRO)."""
        return self.rt.full_gradients()

    def stats(self) -> dict:
        return self.rt.stats()

    def arenas(self) -> list[torch.Tensor]:
        """The device slot arenas (model data: what a saved ``weight.t()`` views)."""
        return [p.arena for p in self.rt.mgr.pools.values() if p.arena is not None]

    def watch_activations(self, meter) -> None:
        """Pass the activations this model's saved-tensor hooks keep through ``meter``'s ``pack`` /
        ``unpack`` (a :class:`~parallel4d.memory.SavedActivations`; None: stop)."""
        self.rt.saved.outer = meter

    def state_dict(self) -> dict:
        """``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}`` with full tensors."""
        return self.rt.optimizer_state_dict(self.param_groups)

    def load_state_dict(self, sd: dict) -> None:
        self.rt.load_optimizer_state_dict(sd)
        for group, saved in zip(self.param_groups, sd.get("param_groups", [])):
            group.update({k: float(saved[k]) for k in ("lr", "eps", "weight_decay") if k in saved})
            if "betas" in saved:
                group["betas"] = tuple(float(b) for b in saved["betas"])
