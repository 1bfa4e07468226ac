"""A torchrun / torchelastic job: this attempt's own store, and what the attempt is.

torchrun's c10d and static rendezvous give the workers one TCPStore server that
an agent hosts and that outlives every restart (``TORCHELASTIC_USE_AGENT_STORE``).
A restarted attempt's workers therefore meet in a store that still holds the
previous attempt's keys, and ``init_process_group`` writes the same keys in every
attempt: a worker can read a dead peer's address from it and fail with "Gloo
connectFullMesh failed … Connection refused" (NCCL reads a stale unique id the
same way; pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt:
each agent counts only its own restarts, and an agent that joins after a node
loss starts again from 0.

So every attempt gets a store that no earlier attempt wrote to. Rank 0 hosts a
new TCPStore on a free port and publishes ``host:port:nonce`` under one key of the
agent's store. Another rank may read the previous attempt's entry there; that
server died with its attempt (connection refused), or the port now serves another
store (a different nonce), so the rank reads the key again until a store answers
with the nonce it was given.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from parallel4d.distributed.comm import CommTimeout, named
from parallel4d.config.errors import ConfigError

NONCE_KEY = "parallel4d/attempt-nonce"
# How long a rank tries one published address before reading the key again.
_PROBE_S = 3.0


def under_torchelastic() -> bool:
    """Whether a torchelastic agent (torchrun) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def attempt() -> dict:
    """What torchelastic says of this attempt (for summary.json); empty outside torchrun."""
    if not under_torchelastic():
        return {}
    env = os.environ
    return {"run_id": env["TORCHELASTIC_RUN_ID"],
            "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "max_restarts": int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)),
            "nodes": int(env.get("GROUP_WORLD_SIZE", 1)), "node_rank": int(env.get("GROUP_RANK", 0))}


def shares_agent_store() -> bool:
    """Whether the workers are handed the agent's long-lived store (torchrun's default)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def replacement_warning() -> str | None:
    """Why a node that replaces a lost one could not join this job, if it could not; else None.

    torch 2.13's c10d agents publish the bootstrap store's address in their first round only, so
    with the shared store (the default) an agent started later waits for it and fails (the
    agents' ``role_info`` wait). Restarts of the same agents are not affected.
    """
    env = os.environ
    if shares_agent_store() and int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 \
            and int(env.get("GROUP_WORLD_SIZE", 1)) > 1:
        return ("torchrun shares its rendezvous store with the workers (torch's default): restarts resume, but an "
                "agent started to replace a lost node could not join this job; export "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun on every node to allow it")
    return None


def job_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The store this attempt's process group meets in (env:// variables; every rank calls this).

    torchrun's shared agent store: :func:`attempt_store`. Otherwise (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    or another launcher) rank 0 hosts it at ``MASTER_ADDR:MASTER_PORT``, which torchrun picks anew
    for every attempt. Either way its waits end after ``timeout_s`` (``train.join_timeout_s``), not
    after one collective's limit: the ranks start seconds (a slow shared filesystem: minutes) apart.
    """
    if shares_agent_store():
        store = attempt_store(rank, world_size, timeout_s)
    else:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    _all_arrive(store, rank, world_size, timeout_s)
    return store


def _all_arrive(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait in ``store`` until every rank got there. The process group's own set-up waits for its
    peers only one collective's limit (``train.timeout_s``), shorter than start-up skew can be."""
    if store.add("parallel4d/arrived", 1) == world_size:
        store.set("parallel4d/all-arrived", "1")
    try:
        store.wait(["parallel4d/all-arrived"], timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError
        arrived = store.add("parallel4d/arrived", 0)
        raise CommTimeout(f"rank {rank}: joining the job: {arrived} of {world_size} ranks arrived within "
                          f"{timeout_s:g}s (train.join_timeout_s); did every node start its workers?") from None


def attempt_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """A TCPStore of this attempt only: hosted by rank 0, found through the agent's store.

    Every rank of the attempt calls this; each returns a store client (rank 0: the
    server) whose waits end after ``timeout_s``. Raises ``CommTimeout`` naming this
    rank when rank 0's store is not found within ``timeout_s``.
    """
    timeout = timedelta(seconds=timeout_s)
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    key = f"parallel4d/attempt-store/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if rank == 0:
        server = dist.TCPStore(_own_host(), 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        server.set(NONCE_KEY, nonce)
        agent.set(key, f"{_own_host()}:{server.port}:{nonce}")
        return server
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            host, port, nonce = agent.get(key).decode().rsplit(":", 2)
        except RuntimeError:  # DistStoreError: nothing published within the store's timeout
            raise CommTimeout(f"rank {rank}: joining the torchrun attempt: rank 0 published no store within "
                              f"{timeout_s:g}s (train.join_timeout_s; is rank 0 running?)") from None
        client = _probe(host, int(port), nonce)
        if client is not None:
            client.set_timeout(timeout)
            return client
        if time.monotonic() > deadline:
            raise CommTimeout(f"rank {rank}: joining the torchrun attempt: rank 0 published no store of this "
                              f"attempt within {timeout_s:g}s (train.join_timeout_s; last seen {host}:{port}, which "
                              "does not answer)")
        time.sleep(0.2)


def _probe(host: str, port: int, nonce: str) -> dist.Store | None:
    """A client of the store at ``host:port`` if it is this attempt's (answers ``nonce``), else None."""
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=_PROBE_S))
        return client if client.get(NONCE_KEY).decode() == nonce else None
    except (RuntimeError, ValueError, OSError):  # refused (the previous attempt's), or not answering it
        return None


def _own_host() -> str:
    """This host's address as the other nodes reach it: the agents' MASTER_ADDR on the first node."""
    if os.environ.get("GROUP_RANK", "0") == "0":
        return os.environ["MASTER_ADDR"]
    return socket.getfqdn()


def check_nodes_agree(config: dict, shared_dir: Path | None) -> None:
    """Every rank runs rank 0's ``config`` and sees the files rank 0 writes in ``shared_dir``.

    Collective over the default group (two object gathers, at start-up). Raises
    ``ConfigError`` on every rank naming the first rank, its host and what differs: a
    node started with another job file or ``--set`` value, or a checkpoint directory
    that is not one shared directory (each node would write its shards to its own disk
    and no checkpoint would be complete).
    """
    rank, host = dist.get_rank(), socket.gethostname()
    probe = None
    if shared_dir is not None and rank == 0:
        probe = Path(shared_dir) / f".parallel4d-shared-{uuid.uuid4().hex}"
        probe.write_text(host)
    sent = [(config, probe)]
    with named("start-up: rank 0's config and probe file sent to every rank"):
        dist.broadcast_object_list(sent, src=0)
    lead_config, lead_probe = sent[0]
    problem = None
    differ = _differences(lead_config, config)
    if differ:
        problem = (f"rank {rank} (host {host}) runs another config than rank 0: {'; '.join(differ[:4])}; start "
                   "every node with the same job file and --set values")
    elif lead_probe is not None and not lead_probe.is_file():
        problem = (f"rank {rank} (host {host}) does not see the file {lead_probe} that rank 0 wrote: the checkpoint "
                   "directory must be one directory shared by every node (NFS, Lustre, …); set checkpoint.dir to "
                   "a path on a shared filesystem")
    problems = [None] * dist.get_world_size()
    with named("start-up: every rank's view of the config and the checkpoint directory gathered"):
        dist.all_gather_object(problems, problem)
    if probe is not None:
        probe.unlink(missing_ok=True)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise ConfigError(first)


def _differences(want: dict, got: dict, prefix: str = "") -> list[str]:
    """``field: rank 0's value vs this rank's`` for every leaf where the two configs differ."""
    out = []
    for key in sorted(set(want) | set(got)):
        a, b, name = want.get(key), got.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, name + ".")
        elif a != b:
            out.append(f"{name}={a!r} on rank 0, {b!r} here")
    return out
