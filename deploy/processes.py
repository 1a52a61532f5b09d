"""Child processes of the stack: each the leader of its own process group,
its output in a log file; and the members of a process group (via /proc).

deploy.stack starts and supervises them; deploy.runtime_models starts and
stops the workers of models added at run time through the stack.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path


class StackInterrupted(Exception):
    """A stop was asked for (``Stack.stop_requested``) while the stack was
    starting or restarting something; the caller stops the stack."""


class StackError(RuntimeError):
    """A component failed to start or become ready (message names it and
    carries the tail of its log)."""


def _prepare_child() -> None:
    # Runs in the child before exec.  A blocked signal stays blocked across
    # exec: spawned from a thread that blocks SIGINT/SIGTERM, a router or
    # worker would never see the stop it is sent (and be SIGKILLed after the
    # grace period, its drain lost) -- so every component starts unblocked.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGINT, signal.SIGTERM):  # (nor ignored: an ignored signal stays so across exec too)
        signal.signal(sig, signal.SIG_DFL)
    # If the launcher dies without stopping us (SIGKILL, a crashed test run),
    # the kernel sends SIGTERM.  Linux only.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid`` (via /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


class Component:
    """One child process (the leader of its own process group) and its log."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str], cwd: str):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                # Its own process group (pgid == pid), in the launcher's session.
                # Not a session of its own: with Linux's autogroups each session
                # is a scheduling group, and a group that sleeps most of the time
                # (the router, Envoy) waits behind one whose threads spin (vLLM's
                # engine) -- runqueue waits of ~50 ms: TTFT p99 ~100 ms at 5 req/s
                # on 2 CPUs, 12 ms with one group (bench/results/2026-12-02-autogroup.md).
                process_group=0,
                preexec_fn=_prepare_child,
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exited(self) -> int | None:
        """Exit status if the process has ended, else None."""
        return self.proc.poll() if self.proc else None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # group already empty

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, what: str) -> StackError:
        status = self.exited()
        state = f"exited with status {status}" if status is not None else "still running"
        return StackError(f"{self.name}: {what} ({state}); log {self.log_path}, last lines:\n{self.tail()}")
