"""Every operation that would make the host wait for a GPU, counted on a CPU run: :class:`HostSyncs`.

On a GPU the host queues kernels and runs ahead; an operation that needs a value the GPU computes
(or a blocking copy) stops it until the GPU has caught up, and the GPU then idles while the host
queues the next work. On CPU nothing waits, so such an operation looks like any other.
:class:`HostSyncs` extends :class:`~device_audit.DeviceAudit` (which follows where a GPU run would
hold each tensor: the mesh's device ``cpu:0`` or the host) and records, with the file:line of the
package or test code that made it:

* a read of a device tensor's value on the host: ``.item()``, ``.tolist()``, ``.numpy()``,
  ``float(t)`` / ``int(t)`` / ``bool(t)`` (``if t:``) / ``operator.index(t)``, formatting or printing
  it, ``x in t``, and the ops whose result's size or answer depends on values (``nonzero``, ``bincount``,
  ``masked_select``, ``unique``, one-argument ``where``, ``equal``, ``allclose``, a boolean mask
  index);
* a blocking copy between device and host: ``.cpu()`` / ``.to("cpu")`` / ``.numpy()`` /
  ``host.copy_(device)`` of a device tensor, ``.to(device)`` / ``.cuda()`` / ``device.copy_(host)``
  of a host tensor, and ``torch.tensor(data, device=the device)`` (built on the host, then copied).
  A copy with ``non_blocking=True`` is not counted when its host side is page-locked
  (``.pin_memory()``): that is the one way a copy does not wait;
* ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize``
  (patched: on a machine without CUDA they only record);
* ``torch.distributed``'s object collectives and ``barrier`` (on NCCL they read device tensors back);
* a timed wait on a collective's or transfer's work, ``Work.wait(timeout)``: on NCCL it polls the host
  until the GPU has finished the work. The meshes built while counting wait as on NCCL
  (:meth:`HostSyncs.__enter__`): stream-ordered, their limits left to the mesh's
  :class:`~parallel4d.distributed.deadlines.Deadlines` (checked at the read steps), which is what a
  GPU run does; an untimed ``Work.wait()`` only orders the stream and is not counted;
* hetero's chunk copies as its CUDA protocol runs them (:mod:`parallel4d.hetero.transfers`): a copy
  queued by ``Transfers.run`` goes on the copy stream between a page-locked buffer and the device
  and waits for nothing, so it is not counted; ``Transfers.sync`` (the host about to read a host
  backing waits for the copy stream) is.

A read of a host tensor (a step counter torch keeps on the host, a data loader's indices) waits
for nothing and is not counted. Calls are attributed to the innermost frame in the repository
(``parallel4d/``, ``tests/``, ``benchmarks/``), with the innermost frame when that is elsewhere
(e.g. ``torch/optim/adam.py:… via parallel4d/engine/step.py:…``).

``label`` names what runs now (e.g. the step): :meth:`count_by_label` groups the records by it;
:meth:`watch_steps` sets it to ``"step N"`` each time a trainer's ``train_step`` starts.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from device_audit import DeviceAudit, _target_device, _tensors
from nccl_like import meshes_with_deadlines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN = {os.path.abspath(__file__), os.path.join(ROOT, "tests", "device_audit.py"),
        os.path.abspath(torch.overrides.__file__)}  # the frames that hand a call to the mode
_REPO_DIRS = tuple(os.path.join(ROOT, d) + os.sep for d in ("parallel4d", "tests", "benchmarks", "examples"))

# Tensor methods and torch functions that read a tensor's values on the host.
READS = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__", "__format__",
         "__repr__", "__str__", "__array__", "__contains__", "nonzero", "masked_select", "unique",
         "unique_consecutive", "argwhere", "equal", "allclose", "is_nonzero", "bincount"}
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list", "barrier", "monitored_barrier")


@dataclass(frozen=True)
class Sync:
    """One operation that would make the host wait: ``what`` (e.g. ``item``, ``.to(host)``),
    ``where`` (``file:line`` in the repository, innermost first) and ``label`` (what ran then)."""

    what: str
    where: str
    label: str

    @property
    def site(self) -> str:
        """The repository file that made it (``parallel4d/engine/step.py``), without the line."""
        return self.where.rsplit(" via ", 1)[-1].rsplit(":", 1)[0]

    def __str__(self) -> str:
        return f"{self.label}: {self.what} at {self.where}"


def _short(path: str) -> str:
    """``path`` from the repository root, or from site-packages (``torch/optim/adam.py``)."""
    if path.startswith(ROOT + os.sep):
        return os.path.relpath(path, ROOT)
    return path.split("site-packages" + os.sep, 1)[-1]


def _site() -> str:
    """``path:line`` of the innermost repository frame outside this helper (``via`` the innermost
    frame when that one is elsewhere, e.g. in torch)."""
    frame, innermost, mine = sys._getframe(1), None, None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path not in _OWN:
            here = f"{_short(path)}:{frame.f_lineno}"
            innermost = innermost or here
            if path.startswith(_REPO_DIRS):
                mine = here
                break
        frame = frame.f_back
    if mine is None:
        return innermost or "?"
    return mine if innermost == mine else f"{innermost} via {mine}"


class _Passed:
    """A stream marker on CPU: the host ran the work before it, so the stream is past it."""

    @staticmethod
    def query() -> bool:
        return True


class HostSyncs(DeviceAudit):
    """Records every host sync (:class:`Sync`) while active (``with HostSyncs() as syncs:``); see the module."""

    def __init__(self):
        super().__init__()
        self.syncs: list[Sync] = []
        self.label = "start"
        self._quiet = 0  # inside a call counted as a whole (an object collective) or hetero's Transfers.run
        self.pinned = weakref.WeakSet()  # storages made by pin_memory(): a non-blocking copy from them is async
        self._undo: list[tuple[object, str, object]] = []

    # --- recording ---------------------------------------------------------------------
    def record(self, what: str) -> None:
        self.syncs.append(Sync(what, _site(), self.label))

    def count_by_label(self) -> Counter:
        return Counter(s.label for s in self.syncs)

    def at(self, label: str) -> list[Sync]:
        return [s for s in self.syncs if s.label == label]

    def watch_steps(self, trainer_cls):
        """Patch ``trainer_cls.train_step`` (undone on exit) so each call labels what follows it
        ``"step N"`` (N: the step it takes, from 1), until the next call."""
        real = trainer_cls.train_step

        def train_step(trainer, *args, **kwargs):
            self.label = f"step {trainer.step + 1}"
            return real(trainer, *args, **kwargs)

        self._undo.append((trainer_cls, "train_step", real))
        trainer_cls.train_step = train_step
        return self

    # --- what waits --------------------------------------------------------------------
    def _device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and not self.is_host(t)

    @staticmethod
    def _non_blocking(kwargs: dict, args: tuple) -> bool:
        return bool(kwargs.get("non_blocking", any(a is True for a in args)))

    def _async_copy(self, host_side: torch.Tensor, kwargs: dict, args: tuple = ()) -> bool:
        try:
            return self._non_blocking(kwargs, args) and host_side.untyped_storage() in self.pinned
        except (RuntimeError, NotImplementedError):
            return False

    def _check(self, func, args, kwargs) -> None:
        name = getattr(func, "__name__", "")
        if self._quiet:
            return
        first = args[0] if args else None
        if name in READS:
            if any(self._device(t) for t in _tensors(args)):
                self.record(name)
        elif name == "__getitem__" and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if self._device(first) and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.record("boolean-mask index")
        elif name == "where" and len(args) + len(kwargs) == 1:
            if self._device(first):
                self.record("where(condition)")
        elif name in ("cpu", "to", "cuda") and isinstance(first, torch.Tensor):
            to_device = name == "cuda" or (name == "to" and self._moves_to_device(func, args, kwargs))
            to_host = name == "cpu" or (name == "to" and self._moves_to_host(func, args, kwargs))
            if to_host and self._device(first) and not (name == "to" and self._non_blocking(kwargs, args[2:])):
                self.record(f".{name}(host)")
            elif to_device and self.is_host(first) and not self._async_copy(first, kwargs, args[2:]):
                self.record(f".{name}(device) of a host tensor")
        elif name == "copy_" and len(args) > 1:
            dst, src = args[0], args[1]
            if self._device(dst) and self.is_host(src) and not self._async_copy(src, kwargs, args[2:]):
                self.record("device.copy_(host)")
            elif self.is_host(dst) and self._device(src) and not self._non_blocking(kwargs, args[2:]):
                self.record("host.copy_(device)")
        elif name in ("tensor", "as_tensor", "asarray") and not list(_tensors(args)):
            if kwargs.get("device") is not None and self._placed_by_target(kwargs["device"]):
                self.record(f"torch.{name}(data, device=...)")

    def _moves_to_device(self, func, args, kwargs) -> bool:
        target = _target_device(func, args, kwargs)
        return target is not None and self._placed_by_target(target)

    def _moves_to_host(self, func, args, kwargs) -> bool:
        target = _target_device(func, args, kwargs)
        return target is not None and not self._placed_by_target(target)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        out = super().__torch_function__(func, types, args, kwargs)
        if getattr(func, "__name__", "") == "pin_memory":
            for t in _tensors(out):
                self.pinned.add(t.untyped_storage())
        return out

    # --- patched waits -----------------------------------------------------------------
    def _patch(self, owner, name: str, what: str, call_through) -> None:
        real = getattr(owner, name, None)
        if real is None:
            return

        def waits(*args, **kwargs):
            self.record(what)
            self._quiet += 1  # what it does inside is this one wait
            try:
                return real(*args, **kwargs) if call_through() else None
            finally:
                self._quiet -= 1

        self._undo.append((owner, name, real))
        setattr(owner, name, waits)

    def __enter__(self):
        has_cuda = torch.cuda.is_available
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize", has_cuda)
        self._patch(torch.cuda.Event, "synchronize", "Event.synchronize", has_cuda)
        self._patch(torch.cuda.Stream, "synchronize", "Stream.synchronize", has_cuda)
        for name in OBJECT_COLLECTIVES:
            self._patch(dist, name, f"dist.{name}", lambda: True)
        self._patch_hetero()
        self._patch_waits()
        return super().__enter__()

    def _patch_waits(self) -> None:
        """Meshes get NCCL's stream-ordered waits (their deadlines' markers are done at once: on CPU the
        untimed wait has blocked until the work was done); ``Work.wait(timeout)`` is counted."""
        real_wait = dist.Work.wait

        def wait(work, *args, **kwargs):
            if args or kwargs.get("timeout") is not None:
                self.record("Work.wait(timeout)")
            return real_wait(work, *args, **kwargs)

        self._undo += [meshes_with_deadlines(_Passed), (dist.Work, "wait", real_wait)]
        dist.Work.wait = wait

    def _patch_hetero(self) -> None:
        from parallel4d.hetero.transfers import Transfers

        real_run = Transfers.run

        def run(transfers, op, *args, **kwargs):
            self._quiet += 1
            try:
                return real_run(transfers, op, *args, **kwargs)
            finally:
                self._quiet -= 1

        self._undo.append((Transfers, "run", real_run))
        Transfers.run = run
        self._patch(Transfers, "sync", "hetero Transfers.sync (copy streams)", lambda: True)

    def __exit__(self, *exc):
        while self._undo:
            owner, name, real = self._undo.pop()
            setattr(owner, name, real)
        return super().__exit__(*exc)
