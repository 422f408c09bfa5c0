"""N hosts as network namespaces behind one bridge, each host's link shaped with ``tc tbf``.

Layout: a switch namespace ``<prefix>-sw`` holds bridge ``br0``; host i is namespace
``<prefix>-h<i>`` with address ``198.18.0.<i+1>/24`` (RFC 2544's benchmarking range) on its end of
a veth pair whose other end is a port of the bridge. A host's egress is shaped on its own veth
(``tbf rate R burst 512kb latency 50ms``), so every byte a host sends crosses a link of rate R.

Only namespaces this object created are touched, and :meth:`down` removes them (with their veths
and the bridge) even when the benchmark fails: use it as a context manager; SIGTERM and SIGHUP
are turned into an exception while it is up, so ``finally`` runs on those too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

SUBNET = "198.18.0.0/24"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _sh(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True)


class _Interrupted(BaseException):
    """A signal arrived while the cluster was up (BaseException: not swallowed by ``except Exception``)."""


@dataclass
class Cluster:
    hosts: int
    rate: str = "1gbit"          # tc rate syntax: "200mbit", "1gbit", ...
    burst: str = "512kb"
    prefix: str = field(default_factory=lambda: f"psgd{os.getpid() % 100000}")
    created: List[str] = field(default_factory=list)
    _old_handlers: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts must be in 1..200, got {self.hosts}")

    # ---------------------------------------------------------------------------- names
    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def address(self, host: int) -> str:
        return f"198.18.0.{host + 1}"

    def host_of(self, address: str) -> int:
        for i in range(self.hosts):
            if self.address(i) == address:
                return i
        raise KeyError(f"{address} is not a host of this cluster")

    # ------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def _on_signal(self, signum: int, frame: Any) -> None:
        raise _Interrupted(f"signal {signum}")

    def up(self) -> None:
        _ip("netns", "add", self.switch)
        self.created.append(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns, switch_end = self.namespace(i), f"h{i}"
            _ip("netns", "add", ns)
            self.created.append(ns)
            # Each end is born inside its namespace, so no interface ever appears in the root
            # namespace (nothing to clean up there if we are killed halfway).
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", switch_end, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
            _ip("-n", self.switch, "link", "set", switch_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rate,
                 "burst", self.burst, "latency", "50ms"])
        self._wait_reachable()

    def reshape(self, rate: str) -> None:
        """Changes every host's link rate in place (no new namespaces)."""
        for i in range(self.hosts):
            _sh(["tc", "-n", self.namespace(i), "qdisc", "change", "dev", "eth0", "root", "tbf", "rate", rate,
                 "burst", self.burst, "latency", "50ms"])
        self.rate = rate

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """A TCP connection from host 0 to a listener on every other host (no ping on this machine)."""
        listen = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                  "s.bind((sys.argv[1], 18515)); s.listen(); s.settimeout(%s); s.accept()" % timeout)
        connect = ("import socket,sys,time\nend=time.time()+%s\nwhile True:\n try:\n  "
                   "socket.create_connection((sys.argv[1], 18515), 1); break\n except OSError:\n"
                   "  assert time.time() < end, 'unreachable'; time.sleep(0.05)" % timeout)
        for i in range(1, self.hosts):
            server = subprocess.Popen(self.exec(i, [sys.executable, "-c", listen, self.address(i)]))
            try:
                ok = subprocess.run(self.exec(0, [sys.executable, "-c", connect, self.address(i)]),
                                    capture_output=True, timeout=timeout + 5).returncode == 0
            finally:
                server.kill()
                server.wait()
            if not ok:
                raise RuntimeError(f"host {i} ({self.address(i)}) is not reachable from host 0")

    def down(self) -> None:
        """Deletes the namespaces this object created (their veths and the bridge go with them)."""
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -------------------------------------------------------------------------- running
    def exec(self, host: int, cmd: Sequence[str]) -> List[str]:
        """``cmd`` run on ``host``: in its namespace, with its own UTS namespace whose host name is
        its address (Horovod and Open MPI then tell the hosts apart; nothing else changes)."""
        inner = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "sh", "-c", inner,
                self.address(host), *cmd]


def leftover_namespaces(prefix: Optional[str] = None) -> List[str]:
    """Namespaces named like ours (all runs' when ``prefix`` is None)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    names = [w for w in out if w.startswith("psgd") and ("-h" in w or w.endswith("-sw"))]
    return [n for n in names if prefix is None or n.startswith(prefix + "-")]
