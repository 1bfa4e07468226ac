"""What ``pipeline.hop_cost: auto`` builds a pipeline's order for: one activation hop's time between pp
ranks and one chunk's forward time, measured at start on the job's own chunks and links.

The hop: every pp rank sends an activation-sized buffer to the next pp rank while receiving one from the
previous (one ring shift, both directions of every link busy, as in a pipeline's steady state), a few
times after a warm-up. The forward: one of this rank's chunks (a middle one where it has one: the
embedding and the head are not what most hops wait for) on a zero input, without gradients. Both are
averaged over every rank of the job, so every rank builds the same order. Start-up only: it reads the
device back and synchronises, which a step never does.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel4d.distributed import comm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run, device: torch.device, repeats: int) -> float:
    """Mean seconds of ``run()`` over ``repeats`` calls after one warm-up, the device drained around them."""
    run()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def hop_seconds(mesh, activation_shape, dtype: torch.dtype, timeout_s: float, repeats: int = 5) -> float:
    """One ring shift of an activation ``activation_shape`` over the pp group (collective over it)."""
    device, me, pp = mesh.device, mesh.rank("pp"), mesh.size("pp")
    send = torch.zeros(activation_shape, dtype=dtype, device=device)
    recv = torch.empty_like(send)
    ahead, behind = mesh.global_rank("pp", (me + 1) % pp), mesh.global_rank("pp", (me - 1) % pp)

    def shift():
        works = comm.p2p([("send", send, ahead), ("recv", recv, behind)], mesh.group("pp"), label="pp.probe")
        comm.wait(works, timeout_s, f"pp rank {me}: the hop_cost probe's transfer")

    return _timed(shift, device, repeats)


@torch.no_grad()
def forward_seconds(chunks: dict, first_chunk: int, last_chunk: int, activation_shape, dtype: torch.dtype,
                    device: torch.device, repeats: int = 3) -> float:
    """One forward of one of ``chunks`` (chunk id → module; a middle one when there is one) on zeros:
    tokens ``activation_shape[:2]`` for ``first_chunk``, else an activation."""
    middle = [c for c in sorted(chunks) if c not in (first_chunk, last_chunk)]
    c = middle[0] if middle else min(chunks)
    x = (torch.zeros(activation_shape[:2], dtype=torch.long, device=device) if c == first_chunk
         else torch.zeros(activation_shape, dtype=dtype, device=device))
    return _timed(lambda: chunks[c](x), device, repeats)


def agreed(values: list[float], device: torch.device) -> list[float]:
    """``values`` averaged over every rank of the job (equal on all; read back once)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, None, label="pp.probe")
    return (t / dist.get_world_size()).tolist()
