"""Which worker's failure caused the others: the error reports the workers wrote, read and ranked.

A real error comes before a killed worker, which comes before one that stopped answering; never a
peer that only saw it leave (:func:`is_consequence`, :func:`lost_peer`).
"""

from __future__ import annotations

import os
import pickle
import signal

from parallel4d.launcher.workers import exit_status, process_state


def _error_report(tmp: str, rank: int) -> tuple[float, str, BaseException | None] | None:
    """``(time, details, the exception if one of spawn's refusals)`` of rank's error report, or None."""
    path = os.path.join(tmp, f"result{rank}.pkl")
    try:
        with open(path, "rb") as f:
            status, payload = pickle.load(f)
        when = os.path.getmtime(path)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    if status != "error":
        return None
    details, refusal = payload
    return when, details, refusal


def refusal_of(tmp: str, rank: int | None) -> BaseException | None:
    """The refusal (one of spawn's ``refusals``) that rank reported, or None."""
    report = _error_report(tmp, rank) if rank is not None else None
    return report[2] if report else None


def _reports(procs, tmp) -> dict[int, tuple[float, str]]:
    """``{rank: (time, details)}`` of every error a worker has reported so far."""
    found = {r: _error_report(tmp, r) for r in range(len(procs))}
    return {r: report[:2] for r, report in found.items() if report is not None}


def blame(procs, tmp, settled: bool) -> tuple[int, str] | None:
    """``(rank, details)`` of the failure that caused the others, or None to look again later.

    Order: the earliest error that is not a consequence of another rank leaving; then a
    worker that died without a word (killed); then, once ``settled``, a rank that stopped
    answering (alive but silent while its peers timed out), else the earliest consequence.
    A worker that aborted without a word (SIGABRT) counts as a consequence: NCCL's watchdog
    aborts a rank whose collective outlived the group's timeout, the wait on a stopped peer.
    The consequence shown is the earliest timeout before any lost peer: a timed-out rank's gloo
    closes its sockets before its own report is written, so a peer's "connection closed" can be
    on disk first, though it only echoes the timeout (which names the action that never finished).
    """
    reports = _reports(procs, tmp)
    causes = sorted((t, r, d) for r, (t, d) in reports.items() if not is_consequence(d))
    if causes:
        _, r, details = causes[0]
        return r, details
    died = [r for r, p in enumerate(procs) if p.poll() not in (None, 0) and r not in reports]
    killed = [r for r in died if procs[r].returncode != -signal.SIGABRT]
    if killed:
        r = killed[0]
        return r, f"process {exit_status(procs[r].returncode)} without reporting an error (killed?)"
    if not settled or not (reports or died):
        return None
    first, details, lost = _first_consequence(procs, reports, died)
    silent = [r for r, p in enumerate(procs) if p.poll() is None and r not in reports]
    if not silent:
        return first, details
    states = {r: process_state(procs[r].pid) for r in silent}
    silent.sort(key=lambda r: states[r] != "stopped")  # a stopped process is the likeliest culprit
    said = ", ".join(f"rank {r} ({states[r]})" for r in silent)
    return silent[0], (f"stopped answering: {said} reported nothing while its peers gave up waiting; "
                       f"rank {first} {'reported first' if lost else 'timed out first'}:\n{details}")


def only_consequences(procs, tmp) -> str | None:
    """When every failure so far is a consequence — each error reported a timeout or a lost peer, and no
    worker died without a word but by an abort (NCCL's watchdog) — the first line of the one
    :func:`blame` would show first (no rank failed of itself); else None."""
    reports = _reports(procs, tmp)
    died = [r for r, p in enumerate(procs) if p.poll() not in (None, 0) and r not in reports]
    if not all(is_consequence(d) for _, d in reports.values()) or not (reports or died):
        return None
    if any(procs[r].returncode != -signal.SIGABRT for r in died):
        return None
    _, details, _ = _first_consequence(procs, reports, died)
    return details.splitlines()[0]


def _first_consequence(procs, reports, aborted) -> tuple[int, str, bool]:
    """``(rank, details, a lost peer?)``: the earliest timeout before any lost peer among the reports,
    else the first rank that aborted without a word."""
    if reports:
        lost, _, first, details = min((lost_peer(d), t, r, d) for r, (t, d) in reports.items())
        return first, details, lost
    r = aborted[0]
    return r, (f"process {exit_status(procs[r].returncode)} without reporting an error: an abort in native "
               f"code, e.g. NCCL's watchdog ending a collective that outlived the group's timeout"), False


_CONSEQUENCES = ("CommTimeout", "PeerLost")
_LOST_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "socket closed", "remote worker")
_TIMEOUT_WORDS = ("timed out", "timeout")


def lost_peer(details: str) -> bool:
    """Does this error report a peer's connection closing (rather than a timeout)?"""
    first = details.splitlines()[0] if details else ""
    return first.startswith("PeerLost") or any(k in first.lower() for k in _LOST_WORDS)


def is_consequence(details: str) -> bool:
    """Does this error look like a consequence of another rank leaving or stalling?"""
    first = details.splitlines()[0] if details else ""
    return first.startswith(_CONSEQUENCES) or any(k in first.lower() for k in _LOST_WORDS + _TIMEOUT_WORDS)
