"""The torch range ``pyproject.toml`` admits is the one the code needs (#28).

:data:`NEEDS` is the table: every torch API the package uses that is younger than a few releases,
the first torch release that has it (where the fact comes from), a probe that finds it in the installed
torch and a string that finds its use in the package. The lower bound must be at least the newest of
them; the installed torch (2.13 on the CPU machines, 2.11 on the GPU one) must be inside the range; an
entry whose use is gone from the package must leave the table (so the bound never rests on dead code).
Adding a younger API means adding its row here, and raising the bound if it is the newest.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "parallel4d"


def _has_param(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _probe_backend_override() -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    return _has_param(init_device_mesh, "backend_override")


def _probe_foreach_norm_dtype() -> bool:
    return bool(torch._foreach_norm([torch.ones(2, dtype=torch.bfloat16)], 2, dtype=torch.float32)[0].dtype
                == torch.float32)


def _probe_gradient_edge() -> bool:
    import torch.autograd.graph as graph

    return hasattr(graph, "GradientEdge") and hasattr(graph, "get_gradient_edge")


def _probe_enable_gqa() -> bool:
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)  # 4 query heads over 2 key/value heads
    return torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).shape == q.shape


def _probe_cudnn_attention_ops() -> bool:
    aten = torch.ops.aten
    return "attn_bias" in str(aten._scaled_dot_product_cudnn_attention.default._schema) and \
        hasattr(aten, "_scaled_dot_product_cudnn_attention_backward")


def _probe_fused_adamw_cpu() -> bool:
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    torch.optim.AdamW([p], fused=True).step()
    return True


#: API → (first torch release with it, where that comes from, probe, a string that finds its use in the package)
NEEDS = {
    "init_device_mesh(backend_override=)": ((2, 9), "pytorch#159371, merged 2025-08", _probe_backend_override,
                                            "backend_override="),
    "torch.serialization.skip_data(materialize_fake_tensors=)": (
        (2, 5), "pytorch#134504", lambda: _has_param(torch.serialization.skip_data.__init__, "materialize_fake_tensors"),
        "skip_data(materialize_fake_tensors"),
    "scaled_dot_product_attention(enable_gqa=)": ((2, 5), "2.5 release notes", _probe_enable_gqa, "enable_gqa="),
    "aten._scaled_dot_product_cudnn_attention(attn_bias, …) and its backward": (
        (2, 5), "pytorch#130482", _probe_cudnn_attention_ops, "_scaled_dot_product_cudnn_attention("),
    "torch.serialization.set_default_mmap_options": ((2, 4), "pytorch#124528",
                                                     lambda: hasattr(torch.serialization, "set_default_mmap_options"),
                                                     "set_default_mmap_options"),
    "torch.nn.functional.rms_norm": ((2, 4), "2.4 release notes", lambda: hasattr(torch.nn.functional, "rms_norm"),
                                     "F.rms_norm"),
    "torch.get_autocast_dtype(device_type)": ((2, 4), "2.4's device-generic autocast API",
                                              lambda: hasattr(torch, "get_autocast_dtype"), "torch.get_autocast_dtype"),
    "torch._foreach_norm(dtype=)": ((2, 4), "pytorch#125665", _probe_foreach_norm_dtype, "_foreach_norm("),
    "fused AdamW on the CPU (torch._fused_adamw_)": ((2, 4), "2.4 release notes", _probe_fused_adamw_cpu,
                                                     "torch._fused_adamw_"),
    "torch.uint16 / torch.uint32 tensors": ((2, 3), "2.3's unsigned dtypes",
                                            lambda: torch.zeros(1, dtype=torch.uint16).long().item() == 0,
                                            "torch.uint16"),
    "GradientEdge, get_gradient_edge, backward through edges": ((2, 3), "torch.autograd.graph, 2.2–2.3",
                                                                _probe_gradient_edge, "get_gradient_edge"),
}


def _range() -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``(lower, upper or None)`` of pyproject's torch requirement ``torch>=A.B[,<C.D]``."""
    text = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'"torch\s*([^"]*)"', text)
    assert spec, "pyproject.toml names no torch requirement"
    lower = re.search(r">=\s*([\d.]+)", spec.group(1))
    upper = re.search(r"<\s*([\d.]+)", spec.group(1))
    assert lower, f"torch requirement {spec.group(1)!r} has no lower bound"
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    return as_tuple(lower.group(1)), as_tuple(upper.group(1)) if upper else None


def _installed() -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", torch.__version__).groups())


def test_the_lower_bound_covers_every_api_the_code_needs():
    lower, _ = _range()
    newest = max(NEEDS.items(), key=lambda kv: kv[1][0])
    assert lower >= newest[1][0], (f"pyproject admits torch {lower} but {newest[0]} needs "
                                   f"{'.'.join(map(str, newest[1][0]))} ({newest[1][1]}): raise the lower bound")


def test_the_installed_torch_is_in_the_range_and_has_every_api():
    lower, upper = _range()
    have = _installed()
    assert have[:len(lower)] >= lower and (upper is None or have[:len(upper)] < upper), \
        f"torch {torch.__version__} is outside pyproject's range {lower} … {upper}"
    missing = [api for api, (_, _, probe, _) in NEEDS.items() if not probe()]
    assert not missing, f"torch {torch.__version__} lacks {missing}"


def test_the_gpu_and_cpu_torch_versions_are_in_the_range():
    """The GPU machine runs torch 2.11, the CPU machines 2.13, and the Makefile's pins are inside."""
    lower, upper = _range()
    make = (ROOT / "Makefile").read_text()
    pins = {name: tuple(int(x) for x in v.split(".")[:2])
            for name, v in re.findall(r"^(TORCH_GPU|TORCH_CPU)\s*\?=\s*torch==([\d.]+)", make, re.M)}
    assert set(pins) == {"TORCH_GPU", "TORCH_CPU"}, f"the Makefile pins {pins}: pin both to torch==X.Y.Z"
    for version in [(2, 11), (2, 13), *pins.values()]:
        assert version >= lower[:2] and (upper is None or version < upper), (version, lower, upper)


def test_every_api_of_the_table_is_still_used():
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    unused = [api for api, (_, _, _, use) in NEEDS.items() if use not in source]
    assert not unused, f"the package no longer uses {unused}: take them out of NEEDS (and maybe lower the bound)"
