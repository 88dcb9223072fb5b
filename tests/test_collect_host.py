"""HostCollector against real processes: an http.server on a loopback port with a CPU-burning child."""
import os
import socket
import subprocess
import sys
import time
import types

import psutil
import pytest

from kvdoctor.collect.base import PolledCollector, SourceUnavailable
from kvdoctor.collect.host import HostCollector
from kvdoctor.model import Event, HostSample

# the server: `python -m http.server` in-process, after starting a child that keeps one core busy
SERVER = """
import runpy, subprocess, sys
burn = "import time\\nend = time.time() + 120\\nwhile time.time() < end: pass"
child = subprocess.Popen([sys.executable, "-c", burn])
print(child.pid, flush=True)
sys.argv = ["http.server", sys.argv[1], "--bind", "127.0.0.1"]
runpy.run_module("http.server", run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.child_pid = int(self.proc.stdout.readline())
        deadline = time.time() + 15
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("http.server did not start")

    def stop(self):
        for pid in (self.child_pid, self.proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        try:
            os.waitpid(self.child_pid, os.WNOHANG)  # reparented to init normally; harmless otherwise
        except ChildProcessError:
            pass
        deadline = time.time() + 10
        while psutil.pid_exists(self.child_pid) and time.time() < deadline:
            try:
                if psutil.Process(self.child_pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)


def tree_cpu_s(srv) -> float:
    total = 0.0
    for pid in (srv.proc.pid, srv.child_pid):
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


@pytest.fixture
def server():
    port = free_port()
    servers = [Server(port)]
    yield port, servers
    for s in servers:
        s.stop()


def test_host_only_without_server():
    c = HostCollector()
    assert isinstance(c, PolledCollector) and c.name == "host" and c.interval_s == 1.0
    first = c.collect(1.0)
    time.sleep(0.05)
    [s] = c.collect(2.0)
    assert isinstance(first[0], HostSample) and first[0].host_cpu_frac is None
    assert s.time_s == 2.0 and s.server_pid is None and s.server_cpu_cores is None
    assert 0 < s.host_mem_used_bytes < s.host_mem_total_bytes == psutil.virtual_memory().total
    assert s.host_cpu_frac is None or 0.0 <= s.host_cpu_frac <= 1.0
    assert s.host_cpu_count == psutil.cpu_count() >= 1  # what turns the busy share into cores


def test_finds_server_by_port_and_measures_tree(server):
    port, servers = server
    srv = servers[0]
    c = HostCollector(port=port)
    t0, cpu0 = time.monotonic(), tree_cpu_s(srv)
    [first] = c.collect(10.0)
    assert first.server_pid == srv.proc.pid
    assert first.server_cpu_cores is None  # no baseline yet
    assert c.server_pids() == {srv.proc.pid, srv.child_pid}
    # the server's arguments, for the engine flags identify reads (kvdoctor.engines.cmdline)
    assert c.server_cmdline() == [sys.executable, "-c", SERVER, str(port)]
    time.sleep(1.0)
    [s] = c.collect(11.0)
    expected = (tree_cpu_s(srv) - cpu0) / (time.monotonic() - t0)  # the busy child's share of a core
    assert s.server_cpu_cores > 0.1 and expected > 0.1  # up to 1 core, less on a loaded machine
    assert s.server_cpu_cores == pytest.approx(expected, abs=0.25)
    own_rss = psutil.Process(srv.proc.pid).memory_info().rss
    assert s.server_rss_bytes > own_rss > 0  # parent + child
    assert 0.0 <= s.host_cpu_frac <= 1.0


def test_by_pid_and_restart_by_port(server):
    port, servers = server
    first_pid = servers[0].proc.pid
    c = HostCollector(pid=first_pid, port=port)
    assert c.collect(1.0)[0].server_pid == first_pid
    servers[0].stop()
    with pytest.raises(SourceUnavailable, match=f"nothing listens on TCP port {port}.*--pid") as down:
        c.collect(2.0)
    host_only, event = down.value.records
    assert host_only.server_pid is None and host_only.host_mem_total_bytes > 0
    assert event.kind == "server-down" and event.detail["pid"] == first_pid
    with pytest.raises(SourceUnavailable) as still_down:
        c.collect(2.5)
    assert [type(r) for r in still_down.value.records] == [HostSample]  # the down event once
    assert c.server_pids() == set()
    servers.append(Server(port))
    out = c.collect(3.0)
    assert [type(r) for r in out] == [HostSample, Event]
    assert out[0].server_pid == servers[1].proc.pid != first_pid
    assert out[0].server_cpu_cores is None  # a new process: no baseline
    assert out[1].kind == "server-restart" and out[1].detail["new_pid"] == servers[1].proc.pid
    assert servers[1].child_pid in c.server_pids()
    time.sleep(0.3)
    again = c.collect(4.0)
    assert len(again) == 1 and again[0].server_cpu_cores is not None


def test_pid_only_does_not_follow_restarts(server):
    port, servers = server
    c = HostCollector(pid=servers[0].proc.pid)
    c.collect(1.0)
    servers[0].stop()
    with pytest.raises(SourceUnavailable, match="exited; pass --port"):
        c.collect(2.0)
    with pytest.raises(SourceUnavailable, match="not found"):
        HostCollector(pid=servers[0].proc.pid).collect(3.0)


def test_port_scan_fallback_when_net_connections_is_denied(server):
    """Non-root users may not list sockets system-wide: the collector scans the processes it can see."""
    port, servers = server

    def denied(kind="inet"):
        raise psutil.AccessDenied()

    fake = types.SimpleNamespace(**{k: getattr(psutil, k) for k in dir(psutil) if not k.startswith("__")})
    fake.net_connections = denied
    c = HostCollector(port=port, psutil_mod=fake)
    assert c.collect(1.0)[0].server_pid == servers[0].proc.pid


def test_no_command_line_before_the_server_is_found():
    assert HostCollector(port=free_port()).server_cmdline() is None


def test_nothing_on_port():
    with pytest.raises(SourceUnavailable, match="server not found: nothing listens"):
        HostCollector(port=free_port()).collect(0.0)


def test_tree_looked_up_every_refresh_not_every_collect(server, monkeypatch):
    """Finding descendants reads every process on the host (psutil), so the tree is looked up every
    tree_refresh_s (and when a member is gone), not on every collect; the members' CPU and memory
    are read each time."""
    port, servers = server
    srv = servers[0]
    lookups = []
    real = psutil.Process.children

    def counting(self, *a, **k):
        lookups.append(self.pid)
        return real(self, *a, **k)

    monkeypatch.setattr(psutil.Process, "children", counting)
    now = [100.0]
    c = HostCollector(port=port, clock=lambda: now[0], tree_refresh_s=10.0)
    cores = []
    for i in range(4):  # within the refresh period: one lookup
        now[0] += 0.25
        time.sleep(0.25)
        cores.append(c.collect(now[0])[0].server_cpu_cores)
    assert len(lookups) == 1 and c.server_pids() == {srv.proc.pid, srv.child_pid}
    assert cores[0] is None and all(x > 0.1 for x in cores[1:])  # the busy child, read each time
    now[0] += 10.0  # the refresh period passed: looked up again
    c.collect(now[0])
    assert len(lookups) == 2 and c.server_pids() == {srv.proc.pid, srv.child_pid}


# a parent whose N children spin pinned to one CPU: they take turns on it, so each waits for the
# core about (N - 1) / N of the time it could run
PINNED = """
import os, subprocess, sys
cpu, n = int(sys.argv[1]), int(sys.argv[2])
burn = "import time\\nend = time.time() + 60\\nwhile time.time() < end: pass"
kids = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(n)]
for k in kids:
    os.sched_setaffinity(k.pid, {cpu})
print("ready", flush=True)
sys.stdin.read()
for k in kids:
    k.kill()
"""


def _run_wait(n: int, cpu: int, seconds: float = 1.5) -> HostSample:
    proc = subprocess.Popen([sys.executable, "-c", PINNED, str(cpu), str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        c = HostCollector(pid=proc.pid)
        c.collect(1.0)  # the baseline
        time.sleep(seconds)
        return c.collect(2.0)[0]
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"),
                    reason="no per-thread schedstat here (not Linux, or schedstats off)")
def test_run_queue_wait_of_the_server_tree_is_measured():
    """Three processes pinned to one CPU wait for it about two thirds of their runnable time; one
    alone on a CPU of its own waits little (the machine's other work aside)."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    crowded = _run_wait(3, cpu)
    alone = _run_wait(1, cpu)
    assert crowded.server_run_wait_cores is not None and alone.server_run_wait_cores is not None
    # three runnable, one running: ~2 cores' worth of waiting, ~1 core of CPU between them
    assert crowded.server_cpu_cores == pytest.approx(1.0, abs=0.35)
    assert crowded.server_run_wait_cores >= 1.2
    share = crowded.server_run_wait_cores / (crowded.server_run_wait_cores + crowded.server_cpu_cores)
    assert share >= 0.5
    assert alone.server_run_wait_cores < 0.5 * crowded.server_run_wait_cores


def test_run_wait_reads_none_for_a_process_that_is_gone():
    from kvdoctor.collect.host import run_wait_s

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert run_wait_s(p.pid) is None
    assert run_wait_s(os.getpid()) is not None or not os.path.exists("/proc/self/schedstat")


def test_run_wait_share_signal_from_host_samples():
    """server_run_wait_frac: the window's wait over its wait + CPU, summed over host samples (busy
    seconds weigh by their work); samples without the reading (older captures) leave it unknown."""
    import numpy as np

    from kvdoctor.capture.memory import from_records
    from kvdoctor.model import CaptureMeta
    from kvdoctor.signals.prepared import Prepared

    def share(samples):
        prep = Prepared(from_records(CaptureMeta(), host=samples))
        return prep.window(0.0, 100.0).value("server_run_wait_frac")

    # the two llama-server readings measured beside two spinning processes and without them
    crowded = [HostSample(time_s=float(t), server_cpu_cores=1.09, server_run_wait_cores=0.97) for t in range(1, 6)]
    assert share(crowded) == pytest.approx(0.97 / 2.06)
    calm = [HostSample(time_s=float(t), server_cpu_cores=1.95, server_run_wait_cores=0.14) for t in range(1, 6)]
    assert share(calm) == pytest.approx(0.14 / 2.09)
    # a server idle most seconds (a short load, then the sidecar's tail): the idle seconds' few
    # microseconds of wait, however large a share of nothing, do not make a calm server crowded
    # (a median of per-second shares read 2/3 here; the quick fault run's rate-limit capture 0.42)
    idle = [HostSample(time_s=float(t), server_cpu_cores=0.001, server_run_wait_cores=0.002) for t in range(6, 12)]
    assert share(calm + idle) == pytest.approx((5 * 0.14 + 6 * 0.002) / (5 * 2.09 + 6 * 0.003))
    assert share(calm + idle) < 0.1
    assert np.isnan(share([HostSample(time_s=1.0, server_cpu_cores=1.0)]))  # recorded before the field
    assert np.isnan(share([HostSample(time_s=1.0, server_cpu_cores=0.0, server_run_wait_cores=0.0)]))  # idle: unknown
