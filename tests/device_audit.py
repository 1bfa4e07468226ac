"""Which tensors would live on the host in a GPU run, told apart on a CPU run.

On CPU every tensor is on ``cpu``, so a collective handed a host tensor (fatal under NCCL)
looks like any other. :class:`DeviceAudit` gives the mesh a device of its own,
``cpu:0`` (``Mesh.device`` is patched to return it), and follows every tensor's
storage through a ``TorchFunctionMode``:

* a factory (no tensor among its arguments) makes a *device* tensor when its
  ``device=`` is the mesh's, a *host* tensor otherwise (no ``device=``, or ``"cpu"``);
* ``t.device`` answers ``cpu:0`` for a device tensor and ``cpu`` for a host one, so
  ``device=t.device`` and ``.to(t.device)`` mean what they would on a GPU;
* ``.to(...)`` / ``.pin_memory()`` / ``.cpu()`` decide by their target; a tensor moved
  between host and device is cloned here (a no-op on the CPU), as a GPU run copies it;
  ``.pin_memory()`` without CUDA (where torch refuses it) is a host copy;
* any other op makes device outputs when one input is a device tensor (as CUDA does,
  a 0-dim host tensor joins a device op), host outputs when its tensor inputs are host.

Every ``torch.distributed`` tensor collective or p2p called from the package (not from
torch's own internals, whose object collectives pick their device themselves) is
checked: a host tensor is recorded with the package line that passed it.
"""

from __future__ import annotations

import sys
import traceback
import weakref

import torch

from parallel4d.distributed.startup import visible_gpus
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

MESH_DEVICE = torch.device("cpu", 0)
# isend / irecv stay unwrapped (P2POp checks that it gets them); their P2POps are checked at
# batch_isend_irecv, which is how the package posts p2p.
CHECKED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "send", "recv",
           "gather", "scatter", "batch_isend_irecv")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif isinstance(obj, dist.P2POp):
        yield obj.tensor


def _is_mesh_device(device) -> bool:
    return device is not None and torch.device(device) == MESH_DEVICE


def _target_device(func, args, kwargs):
    """The device a ``.to`` call moves to (None: no device change asked)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return a  # .to(other): other's placement
        if isinstance(a, (str, torch.device)):
            return a
    return None


class DeviceAudit(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host = weakref.WeakSet()  # untyped storages that would be on the host in a GPU run
        self.violations: list[str] = []
        self._patched: dict[str, object] = {}

    # --- placement ---------------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage() in self.host
        except (RuntimeError, NotImplementedError):  # sparse, meta, ...: no storage to follow
            return False

    def _mark(self, out, host: bool) -> None:
        for t in _tensors(out):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if host:
                self.host.add(storage)
            else:
                self.host.discard(storage)

    def _placed_by_target(self, target) -> bool:
        """True: the target is the mesh device; False: the host."""
        if isinstance(target, torch.Tensor):
            return not self.is_host(target)
        return _is_mesh_device(target)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # `t.device`: where a GPU run has it
            return torch.device("cpu") if self.is_host(args[0]) else MESH_DEVICE
        name = getattr(func, "__name__", "")
        if name == "pin_memory" and not visible_gpus():  # nothing to page-lock: a host copy
            out = args[0].clone()
            self._mark(out, host=True)
            return out
        out = func(*args, **kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if name in ("to", "cpu", "pin_memory", "cuda") and inputs:
            if name == "to":
                target = _target_device(func, args, kwargs)
                if target is None:  # a dtype change keeps the placement
                    self._mark(out, self.is_host(args[0]))
                    return out
                on_device = self._placed_by_target(target)
            else:
                on_device = name == "cuda"
            if on_device == self.is_host(args[0]) and out.untyped_storage() is args[0].untyped_storage():
                out = out.clone()  # a move here is a no-op on the CPU; a GPU run copies
            self._mark(out, not on_device)
        elif not inputs:  # a factory
            self._mark(out, not _is_mesh_device(kwargs.get("device")))
        elif isinstance(out, torch.Tensor) or isinstance(out, (list, tuple)):
            on_device = any(not self.is_host(t) for t in inputs)
            if not (name.endswith("_") and inputs and out is inputs[0]):  # in place: stays where it is
                self._mark(out, not on_device)
        return out

    # --- collectives ------------------------------------------------------------------------
    def _wrap(self, name, fn):
        def checked(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/parallel4d/" in caller.replace("\\", "/"):
                host = [t for t in _tensors(args) if self.is_host(t)] + \
                       [t for t in _tensors(kwargs) if self.is_host(t)]
                if host:
                    where = [f"{f.filename.split('/parallel4d/')[-1]}:{f.lineno} {f.name}"
                             for f in traceback.extract_stack()[:-1] if "/parallel4d/" in f.filename]
                    self.violations.append(f"dist.{name} given {len(host)} host tensor(s) "
                                           f"{[tuple(t.shape) for t in host]} at {where[-3:]}")
            return fn(*args, **kwargs)

        return checked

    def __enter__(self):
        from parallel4d.distributed.mesh import Mesh

        self._patched["Mesh.device"] = Mesh.device
        Mesh.device = property(lambda mesh: MESH_DEVICE)
        for name in CHECKED:
            fn = getattr(dist, name, None)
            if fn is None:  # not in this torch
                continue
            self._patched[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        from parallel4d.distributed.mesh import Mesh

        Mesh.device = self._patched.pop("Mesh.device")
        for name, fn in self._patched.items():
            setattr(dist, name, fn)
        self._patched.clear()
        return super().__exit__(*exc)
