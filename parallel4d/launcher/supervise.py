"""Supervision of a local job's workers until every one has ended, and the launcher's stop signals.

Guarantees: when one worker raises, dies or stops answering, the others are stopped and
:class:`WorkerError` names the cause (:func:`~parallel4d.launcher.blame.blame`) with its traceback, or
the zygote when that dies; a job that outlives ``timeout_s`` is stopped with :class:`WorkerTimeout`.
The stop signals to the launcher (SIGINT, SIGTERM, SIGHUP: :mod:`parallel4d.training.signals`) are
counted, never raised (:class:`Signals`): the first is passed on to the workers (they finish the step,
save and return), a second waits too (for a save in progress above all), a third kills them
(:class:`Interrupted`, saying what was lost).

A job stopped whole (SIGSTOP or Ctrl-Z of its process group) and continued: the time limits here
count only the time it could run; its collectives' limits are gloo's and NCCL's timers, which count
the stop too, so one that ran out meanwhile fails when the job continues — :class:`JobWasStopped` says
so, and blames no rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

from parallel4d.launcher.blame import blame, only_consequences, refusal_of
from parallel4d.launcher.worker_process import JOINED, ZYGOTE_FAILED, read_text
from parallel4d.launcher.workers import Forked, exit_status, signal_process, stop
from parallel4d.training.signals import STOP_SIGNALS, silence_a_hung_up_terminal, stop_signals


class WorkerError(RuntimeError):
    """A worker raised or died (``rank``), or the zygote that forks them died (``rank`` None);
    ``details`` say why."""

    def __init__(self, rank: int | None, details: str):
        self.rank = rank
        self.details = details
        super().__init__(details if rank is None else f"worker rank {rank} failed:\n{details}")


class JobWasStopped(WorkerError):
    """The job was stopped whole (SIGSTOP, Ctrl-Z) for ``stopped_s`` seconds, and its workers' collectives,
    whose limit counted that time, failed when it continued: no rank is at fault."""

    def __init__(self, stopped_s: float, limit_s: float, first: str, lost: str):
        self.stopped_s = stopped_s
        super().__init__(None, (
            f"the job was stopped (SIGSTOP or Ctrl-Z of its whole process group) for {stopped_s:.1f}s, and its "
            f"collectives, whose limit ({limit_s:g}s) counts that time too, had run out when it continued: no rank "
            f"is at fault ({first}); lost: {lost}. To pause a job, stop it with Ctrl-C or SIGTERM (it saves) and "
            "continue it with --set train.resume=true, or raise train.timeout_s above the pause"))


class WorkerTimeout(RuntimeError):
    """The job did not finish within its time limit ``limit_s`` (the time it could run: a stop of the whole
    job does not count); ``starting``: its workers had not all joined the process group by then;
    ``field``: the setting that is the limit, named in the message with the fix."""

    def __init__(self, limit_s: float, running: list[int], starting: bool, field: str | None = None):
        self.limit_s, self.running, self.starting = limit_s, running, starting
        limit = f"{field}={limit_s:g}" if field else f"the job's time limit of {limit_s:g}s"
        if starting:
            message = (f"{limit} ran out while the workers were still starting (importing, joining the process "
                       f"group; ranks still running: {running})")
            message += f"; raise {field} well above their start-up, or leave it out (a week)" if field else ""
        else:
            message = (f"{field + ': ' if field else ''}job did not finish within {limit_s:.0f}s; ranks still "
                       f"running: {running}")
        super().__init__(message)


class Interrupted(KeyboardInterrupt):
    """A signal to the launcher ended the job before its workers stopped cleanly (a third signal, the
    interrupt grace run out, or a worker the signal killed): ``signum``, and what was lost in the message."""

    def __init__(self, signum: int, message: str):
        self.signum = signum
        super().__init__(message)


class Signals:
    """The stop signals to the launcher while it supervises (:func:`~parallel4d.training.signals.stop_signals`),
    counted in ``received``, never raised: an exception unwinding through the supervisor would leave
    before the workers (a second signal even from the handling of the first); the supervision loop acts
    on them instead. ``continued``: how many SIGCONTs came (the job continued after SIGSTOP or Ctrl-Z)."""

    def __init__(self):
        self.received: list[int] = []
        self.continued = 0
        self._old: dict = {}

    def __enter__(self):
        for sig in stop_signals():
            self._catch(sig, self._record)
        self._catch(signal.SIGCONT, self._count_continue)
        return self

    def _catch(self, sig: int, handler) -> None:
        try:
            self._old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass

    def _record(self, signum, frame) -> None:
        self.received.append(signum)
        silence_a_hung_up_terminal()  # a closed terminal's SIGHUP: saying what the launcher waits for must not fail

    def _count_continue(self, signum, frame) -> None:
        self.continued += 1

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# How long to wait, once only consequences (timeouts, lost peers) are reported, for
# the cause to show itself before naming the ranks that stopped answering.
BLAME_GRACE_S = 1.0
# The supervision loop wakes every POLL_S; a longer gap with a SIGCONT in it was a stop of the whole job.
POLL_S = 0.05
FROZEN_S = 0.5


def _say(message: str) -> None:
    print(f"[parallel4d] {message}", file=sys.stderr, flush=True)


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class Supervisor:
    """Watches one job's workers (and zygote) until every one has ended, and acts on the launcher's signals.

    The first signal is passed on to each worker (while the zygote has not forked them all, it is killed
    instead: the job had not started); the workers finish the step, save and return. A second only says
    what the launcher waits for. A third, or ``interrupt_grace_s`` after the first with no save in
    progress, kills them. ``joined()`` is called once, as soon as every worker has joined the process
    group. ``timeout_s`` and the grace count the time the job could run (:meth:`running_time`); a failure
    of the collectives (``collective_limit_s``) just after a stop of the whole job is that stop's."""

    clock = staticmethod(time.monotonic)  # what the supervision waits by (a test's stand-ins replace both)
    sleep = staticmethod(time.sleep)

    def __init__(self, procs: list, zygote: subprocess.Popen | None, tmp: str, signals: Signals, timeout_s: float,
                 interrupt_grace_s: float, saving: Callable[[], str | None] | None,
                 saved: Callable[[], str | None] | None, joined: Callable[[], None] | None = None,
                 collective_limit_s: float | None = None):
        self.procs, self.zygote, self.tmp, self.signals = procs, zygote, tmp, signals
        self.timeout_s, self.interrupt_grace_s = timeout_s, interrupt_grace_s
        self.saving, self.saved = saving or (lambda: None), saved
        self.joined = joined  # None once called
        self.all_joined = False  # every worker has joined the process group
        self.collective_limit_s = collective_limit_s  # the workers' collectives' limit (the process group's)
        self.handled = 0  # signals acted on
        self.passed_on: set[int] = set()  # ranks the first signal has been passed on to
        self.zygote_stopped = False  # killed by the launcher for a stop signal before it forked every worker
        self.grace_until = 0.0  # once a signal came (running time): the workers are killed unless a save is in progress
        self.stopped_s = 0.0  # how long the whole job was stopped (SIGSTOP, Ctrl-Z), all stops together
        self.last_stop: tuple[float, float] | None = None  # (when the job continued, how long it was stopped)
        self._continues_seen = 0
        self._ticked = self.clock()

    def running_time(self) -> float:
        """The monotonic clock less the time the whole job was stopped: what the job's limits count."""
        return self.clock() - self.stopped_s

    def _tick(self) -> None:
        """Each turn of the loop: a gap with a SIGCONT in it was a stop of the whole job (this process too)."""
        now = self.clock()
        gap, self._ticked = now - self._ticked, now
        if self.signals.continued > self._continues_seen:
            self._continues_seen = self.signals.continued
            if gap > FROZEN_S:
                self.stopped_s += gap
                self.last_stop = (now, gap)

    def run(self) -> None:
        """Return when every worker exited 0; raise for the first failure, the deadline or a stop at once."""
        deadline = self.running_time() + self.timeout_s
        first_failure_at = None
        while True:
            self._tick()
            self._act_on_signals()
            if not self.all_joined and os.path.exists(os.path.join(self.tmp, JOINED)):
                self.all_joined = True
                if self.joined is not None:
                    self.joined()
                    self.joined = None
            if self._zygote_failed():
                stop(self.procs)
                raise self._zygote_failure()
            if any(p.poll() not in (None, 0) for p in self.procs):
                if self._zygote_failed():  # it ended since the check above: a worker's poll says so too
                    stop(self.procs)
                    raise self._zygote_failure()
                first_failure_at = first_failure_at or self.clock()
                blamed = blame(self.procs, self.tmp, settled=self.clock() - first_failure_at >= BLAME_GRACE_S)
                if blamed is not None:
                    stopped = self._stop_of_the_job(first_failure_at)  # before stop() kills the rest
                    stop(self.procs)
                    refusal = refusal_of(self.tmp, blamed[0])
                    if refusal is not None:  # raised as itself: one line for the user, no worker traceback
                        raise refusal
                    raise stopped or self._failure(*blamed)
            elif all(p.poll() == 0 for p in self.procs):
                return
            if self.running_time() > deadline:
                running = [r for r, p in enumerate(self.procs) if p.poll() is None]
                stop(self.procs)
                raise WorkerTimeout(self.timeout_s, running, starting=not self.all_joined)
            self.sleep(POLL_S)

    def _stop_of_the_job(self, failed_at: float) -> JobWasStopped | None:
        """The failure as the stop of the whole job, when it was one: timeouts and lost peers only (no error
        of a rank's own, no worker killed) within the collectives' limit of the job's continuing — the
        wait that ran out had been waiting while the job was stopped."""
        if self.last_stop is None or self.collective_limit_s is None:
            return None
        continued_at, stopped_s = self.last_stop
        first = only_consequences(self.procs, self.tmp)
        if first is None or failed_at - continued_at > self.collective_limit_s:
            return None
        return JobWasStopped(stopped_s, self.collective_limit_s, first, self._lost())

    def _act_on_signals(self) -> None:
        while self.handled < len(self.signals.received):
            signum = self.signals.received[self.handled]
            self.handled += 1
            if self.handled == 1:
                self.grace_until = self.running_time() + self.interrupt_grace_s
                if any(isinstance(p, Forked) and not p.forked() for p in self.procs):
                    _say(f"{_name(signum)} received while the workers start: stopping the job")
                else:
                    _say(f"{_name(signum)} received: the workers finish the step, save and stop (waiting up to "
                         f"{self.interrupt_grace_s:g}s, and for as long as a save is in progress; a third signal "
                         "stops them at once)")
            elif self.handled == 2:
                save = self.saving()
                _say(f"{_name(signum)} again: waiting for the save of {save} to complete; another signal stops at "
                     "once and loses it" if save else
                     f"{_name(signum)} again: still waiting for the workers to finish the step and save; another "
                     f"signal stops them at once and loses {self._lost()}")
            else:
                self._kill_now(signum, f"stopped at once by a third signal ({_name(signum)})")
        if self.handled:
            self._pass_on(self.signals.received[0])
            self._check_grace()

    def _pass_on(self, signum: int) -> None:
        """The signal the launcher received, to each worker once (SIGINT stays SIGINT: summary.json says which);
        a zygote that has not forked them all yet is killed instead of waited for: the job had not started."""
        for rank, p in enumerate(self.procs):
            if rank in self.passed_on:
                continue
            if isinstance(p, Forked) and not p.forked():
                if self.zygote.poll() is None:
                    self.zygote_stopped = True
                    self.zygote.kill()  # it ignores the stop signals; its forked workers got theirs above
                continue
            self.passed_on.add(rank)
            if p.poll() is None:
                signal_process(p, signum)

    def _check_grace(self) -> None:
        now = self.running_time()
        if self.saving() is not None:  # never cut a save short: the grace starts again after it
            self.grace_until = max(self.grace_until, now + self.interrupt_grace_s)
        elif now > self.grace_until:
            signum = self.signals.received[0]
            self._kill_now(signum, f"the workers did not stop within interrupt_grace_s={self.interrupt_grace_s:g}s "
                                   f"of {_name(signum)}: stopped at once")

    def _kill_now(self, signum: int, why: str) -> None:
        lost = self._lost()  # while the save in progress is still there to name
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        raise Interrupted(signum, f"{why}; lost: {lost}")

    def _lost(self) -> str:
        """What stopping the workers now loses."""
        save = self.saving()
        parts = [f"the save of {save} in progress"] if save else []
        newest = self.saved() if self.saved is not None else None
        if self.saved is None:
            parts.append("whatever the workers had not saved")
        elif newest is not None:
            parts.append(f"the steps trained since {newest}, the newest complete checkpoint")
        else:
            parts.append("everything trained (there is no complete checkpoint)")
        return " and ".join(parts)

    def _stopped_by_the_signal(self, code: int) -> bool:
        """Did the signal the launcher received (and passed on) end a process that exited with ``code``?"""
        return self.handled > 0 and code in [-s for s in STOP_SIGNALS]

    def _failure(self, rank: int, details: str) -> BaseException:
        """The error for worker ``rank``'s failure: the stop itself when the launcher's signal killed or
        interrupted it (before its own handler was in place: nothing of this process was saved)."""
        interrupted = self.handled > 0 and details.startswith("KeyboardInterrupt")  # a worker not forked (FORK=0)
        if interrupted or self._stopped_by_the_signal(self.procs[rank].returncode):
            signum = self.signals.received[0]
            return Interrupted(signum, f"{_name(signum)} stopped the worker of rank {rank} before it could save; "
                                       f"lost: {self._lost()}")
        return WorkerError(rank, details)

    def _zygote_failed(self) -> bool:
        """The zygote exited non-zero (it exits 0 only after its workers)."""
        return self.zygote is not None and self.zygote.poll() not in (None, 0)

    def _zygote_failure(self) -> BaseException:
        """The error for the zygote's death: the stop itself when the launcher's signal killed it before it
        forked every worker (:meth:`_pass_on`), or a group signal reached it before it ignored them."""
        if self.zygote_stopped or self._stopped_by_the_signal(self.zygote.returncode):
            signum = self.signals.received[0]
            return Interrupted(signum, f"{_name(signum)} stopped the job before its workers started: nothing was lost")
        why = read_text(os.path.join(self.tmp, ZYGOTE_FAILED))
        if why is not None:  # it said why before forking any worker
            return WorkerError(None, f"the process that forks the workers (zygote, pid {self.zygote.pid}) "
                                     f"{exit_status(self.zygote.returncode)} before starting any worker:\n{why}")
        return WorkerError(None, f"the process that forks the workers (zygote, pid {self.zygote.pid}) "
                                 f"{exit_status(self.zygote.returncode)}; its workers were stopped")
