"""The server's process tree and the host, one HostSample per collect (psutil).

The server is found by ``pid`` or by the TCP ``port`` it listens on (psutil.net_connections; when
that is not allowed or shows no owner, the processes this user can inspect are scanned). Its tree is
the process and all its descendants (vLLM's engine core and workers, ...):

* ``server_cpu_cores``: change of the tree's CPU seconds (user + system, plus the children_* times
  of reaped children, so short-lived helpers count) over wall time, summed over the processes seen
  in both collects (one that joined the tree counts from its second sample, not with all the CPU
  time it had when found); None on the first collect
* ``server_run_wait_cores``: change of the tree's threads' run-queue delay (time runnable but waiting
  for a CPU: the second field of Linux's /proc/PID/task/TID/schedstat) over wall time, summed the
  same way; the direct reading of "the engine's threads wait for a core", which the host's busy share
  cannot give (it counts the sidecar and a load generator as other processes too). A thread that
  exits takes its delay with it, so a sum that fell reads as 0 for that interval
* ``server_rss_bytes``: the sum of the tree's RSS (shared pages count once per process)
* ``host_mem_used_bytes``: total - available; ``host_cpu_frac``: busy share of all CPUs since the last collect;
  ``host_cpu_count``: logical CPUs (so the cores other processes took can be told from the server's)

The tree's membership is looked up every :data:`TREE_REFRESH_S` (and at once when a member is
gone), not on every collect: psutil finds descendants by reading every process's ``/proc/PID/stat``
(1.4 ms of Python for 64 processes here, ~22 us a process), in a thread of the process that relays
the proxy's streams (GIL); on a GPU host running hundreds of processes that was milliseconds a
second. The known members' CPU and memory are still read on every collect.

When the server's process goes away the collect raises SourceUnavailable carrying the host-only
HostSample (and, the first time, a ``server-down`` Event); with a port the server is looked up again
on each collect, and a new pid yields a ``server-restart`` Event.
"""
from __future__ import annotations

import importlib
import os
import time
from typing import Any

from ..model import Event, HostSample
from .base import SourceUnavailable

#: how often the server's process tree is looked up again (seconds)
TREE_REFRESH_S = 10.0


class HostCollector:
    name = "host"

    def __init__(self, pid: int | None = None, port: int | None = None, *, interval_s: float = 1.0,
                 psutil_mod: Any = None, clock=time.monotonic, tree_refresh_s: float = TREE_REFRESH_S):
        self.pid, self.port, self.interval_s = pid, port, interval_s
        self.tree_refresh_s = tree_refresh_s
        self._ps = psutil_mod or importlib.import_module("psutil")
        self._clock = clock
        self._proc: Any = None
        self._last_pid: int | None = None
        self._gone: int | None = None  # pid seen to exit, until a server-down event says so
        self._tree_pids: frozenset[int] = frozenset()
        # (clock, root pid, {pid: cpu s}, {pid: run-queue wait s}) at the last collect
        self._prev_tree: tuple[float, int, dict[int, float], dict[int, float]] | None = None
        self._tree: list[Any] = []  # the root and its descendants as last looked up
        self._tree_at = float("-inf")  # clock at that lookup; -inf: look up at the next collect
        self._prev_host: tuple[float, float] | None = None  # (busy s, total s) over all CPUs
        self._cmdline: tuple[int, list[str]] | None = None  # (pid, argv) of the server process

    def server_pids(self) -> set[int]:
        """The server tree's pids as of the last collect (empty when unknown)."""
        return set(self._tree_pids)

    def server_cmdline(self) -> list[str] | None:
        """The server process's arguments as of the last collect (None when unknown or not
        readable); read once per process. Callers keep only the flags they know."""
        proc = self._proc
        if proc is None or not self._alive(proc):  # gone: the next collect finds the new one
            return None
        cached = self._cmdline
        if cached is not None and cached[0] == proc.pid:
            return cached[1]
        try:
            argv = list(proc.cmdline())
        except self._ps.Error:
            return None
        self._cmdline = (proc.pid, argv)
        return argv

    def collect(self, now_s: float) -> list[Any]:
        ps = self._ps
        vm = ps.virtual_memory()
        host = dict(host_mem_used_bytes=int(vm.total - vm.available), host_mem_total_bytes=int(vm.total),
                    host_cpu_frac=self._host_cpu(), host_cpu_count=self._cpu_count())
        if self.pid is None and self.port is None:
            return [HostSample(time_s=now_s, **host)]
        try:
            proc = self._resolve()
        except SourceUnavailable as e:  # keep the host's numbers, and say once that the server went
            e.records.append(HostSample(time_s=now_s, **host))
            if self._gone is not None:
                e.records.append(Event(time_s=now_s, kind="server-down", detail={"source": "host", "pid": self._gone}))
                self._gone = None
            raise
        out: list[Any] = []
        if self._last_pid is not None and proc.pid != self._last_pid:
            out.append(Event(time_s=now_s, kind="server-restart",
                             detail={"source": "host", "old_pid": self._last_pid, "new_pid": proc.pid}))
            self._prev_tree = None
        self._last_pid = proc.pid
        t_now = self._clock()
        if not self._tree or self._tree[0] is not proc or t_now - self._tree_at >= self.tree_refresh_s:
            tree = [proc]
            try:
                tree += proc.children(recursive=True)
            except ps.Error:
                pass
            self._tree, self._tree_at = tree, t_now
        cpu: dict[int, float] = {}
        wait: dict[int, float] = {}
        rss = 0
        for p in self._tree:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu[p.pid] = (t.user + t.system + getattr(t, "children_user", 0.0)
                                  + getattr(t, "children_system", 0.0))
                    rss += p.memory_info().rss
                w = run_wait_s(p.pid)
                if w is not None:
                    wait[p.pid] = w
            except ps.AccessDenied:
                if p is proc:
                    raise SourceUnavailable(f"cannot read server process {p.pid} (access denied); "
                                            "run as its user or root") from None
            except ps.NoSuchProcess:
                self._tree_at = float("-inf")  # a member exited: look the tree up again next time
        self._tree_pids = frozenset(cpu)
        cores = waiting = None
        prev = self._prev_tree
        if prev is not None and prev[1] == proc.pid and t_now > prev[0]:
            cores = max(sum(c - prev[2][pid] for pid, c in cpu.items() if pid in prev[2]), 0.0) / (t_now - prev[0])
            if wait and prev[3]:
                waiting = max(sum(w - prev[3][pid] for pid, w in wait.items() if pid in prev[3]), 0.0) / (t_now - prev[0])
        self._prev_tree = (t_now, proc.pid, cpu, wait)
        out.insert(0, HostSample(time_s=now_s, server_cpu_cores=cores, server_rss_bytes=rss, server_pid=proc.pid,
                                 server_run_wait_cores=waiting, **host))
        return out

    def _cpu_count(self) -> int | None:
        count = getattr(self._ps, "cpu_count", None)
        return count() if count else None

    def _host_cpu(self) -> float | None:
        t = self._ps.cpu_times()
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # Linux counts guest in user
        busy = total - t.idle - getattr(t, "iowait", 0.0)
        prev, self._prev_host = self._prev_host, (busy, total)
        if prev is None or total <= prev[1]:
            return None
        return min(max((busy - prev[0]) / (total - prev[1]), 0.0), 1.0)

    # -- finding the server
    def _alive(self, proc: Any) -> bool:
        try:
            return proc.is_running() and proc.status() != self._ps.STATUS_ZOMBIE
        except self._ps.Error:
            return False

    def _resolve(self) -> Any:
        ps = self._ps
        if self._proc is not None and self._alive(self._proc):
            return self._proc
        if self._proc is not None:
            self._gone, self._proc, self._tree_pids = self._proc.pid, None, frozenset()
        if self.pid is not None and self._last_pid is None:  # first time: the pid asked for
            try:
                proc = ps.Process(self.pid)
            except ps.NoSuchProcess:
                proc = None
            if proc is not None and self._alive(proc):
                self._proc = proc
                return proc
            if self.port is None:
                raise SourceUnavailable(f"server process {self.pid} not found")
        if self.port is None:
            raise SourceUnavailable(f"server process {self.pid} exited; pass --port to follow restarts")
        pid = self._listener_pid(self.port)
        try:
            self._proc = ps.Process(pid)
        except ps.NoSuchProcess:
            raise SourceUnavailable(f"server process {pid} on port {self.port} exited while being looked up") from None
        return self._proc

    def _listener_pid(self, port: int) -> int:
        ps = self._ps
        pids: set[int] = set()
        unowned = False
        try:
            for c in ps.net_connections(kind="tcp"):
                if c.status == ps.CONN_LISTEN and c.laddr and c.laddr.port == port:
                    if c.pid:
                        pids.add(c.pid)
                    else:
                        unowned = True
        except (ps.AccessDenied, PermissionError):
            pass
        if not pids:  # not allowed, or owners hidden: look at the processes we may inspect
            for p in ps.process_iter():
                try:
                    conns = p.net_connections(kind="tcp") if hasattr(p, "net_connections") else p.connections("tcp")
                except ps.Error:
                    continue
                if any(c.status == ps.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
                    pids.add(p.pid)
        if not pids:
            why = (f"TCP port {port} is open but its process cannot be inspected by this user; run as root"
                   if unowned else f"nothing listens on TCP port {port}; is the server up?")
            raise SourceUnavailable(f"server not found: {why} (or pass --pid)")
        return min(pids, key=lambda pid: (self._ppid(pid) in pids, pid))  # workers inherit the socket

    def _ppid(self, pid: int) -> int | None:
        try:
            return self._ps.Process(pid).ppid()
        except self._ps.Error:
            return None


def run_wait_s(pid: int) -> float | None:
    """Seconds the threads of process ``pid`` have spent runnable but waiting for a CPU (the sum
    of /proc/PID/task/*/schedstat's run-queue delay, nanoseconds); None without that file (not
    Linux, schedstats off, the process gone)."""
    total, seen = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
            total += int(fields[1])
            seen = True
        except (OSError, IndexError, ValueError):  # a thread that exited between the two reads
            continue
    return total / 1e9 if seen else None
