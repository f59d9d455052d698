"""Emulated nodes as Linux network namespaces joined through a bridge by rate-limited veth links.

Each node is a namespace with one veth interface and its own address; the other end of every veth sits on a bridge
in the root namespace. Traffic between processes of one node never leaves the namespace (fast, as on a real node);
traffic between nodes crosses two veths and the bridge, and both directions of each node's link go through a
``tbf`` qdisc at ``link_mbit`` (the node's NIC). ``netem`` is not available on the machines this was built on, so
links have bandwidth limits but no added latency.

Everything created carries a per-instance tag in its name, so concurrent emulations do not collide, and
:meth:`EmulatedNetwork.teardown` removes it even after a partial setup.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid

log = logging.getLogger(__name__)


class EmulationUnavailable(RuntimeError):
    """The machine cannot emulate nodes (not root, no ``ip``, no netns); the message says what to do instead."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def check_netns_support() -> None:
    """Raise :class:`EmulationUnavailable` with a fix unless namespaces, veth and tc can be used here."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise EmulationUnavailable(
            "syncasync-emulate needs the `ip` and `tc` commands (Debian/Ubuntu: apt install iproute2); "
            "HINT: run with --no-netns for plain loopback without bandwidth limits"
        )
    if os.geteuid() != 0:
        raise EmulationUnavailable(
            "syncasync-emulate needs root to create network namespaces and rate-limited links; "
            "HINT: run it with sudo, or pass --no-netns (loopback, no bandwidth limit; stragglers are still emulated)"
        )
    probe = f"sa{uuid.uuid4().hex[:6]}probe"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        raise EmulationUnavailable(
            f"cannot create a network namespace ({res.stderr.strip()}); the kernel or container forbids it. "
            "HINT: pass --no-netns"
        )
    _ip("netns", "del", probe, check=False)


class EmulatedNetwork:
    """``num_nodes`` namespaces on a bridge, each node's link limited to ``link_mbit`` in both directions.

    Args:
        num_nodes: number of emulated nodes (>= 1).
        link_mbit: per-node link rate in Mbit/s; ``None`` for no limit.
        burst_kb: tbf bucket size; at least rate/HZ, 256 KB works from 10 Mbit/s to 10 Gbit/s here.
        tag: unique name part (default: random); names must stay within Linux's 15-character limit.

    Example::

        net = EmulatedNetwork(num_nodes=2, link_mbit=100)
        net.setup()
        try:
            subprocess.run(net.exec_prefix(0) + ["python", "train.py"], env={**env, **net.node_env(0)})
        finally:
            net.teardown()
    """

    def __init__(self, num_nodes: int, link_mbit: float | None = None, burst_kb: int = 256, tag: str | None = None):
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if link_mbit is not None and link_mbit <= 0:
            raise ValueError(f"link_mbit must be > 0 (or None for no limit), got {link_mbit}")
        if burst_kb < 1:
            raise ValueError(f"burst_kb must be >= 1, got {burst_kb}")
        self.num_nodes = num_nodes
        self.link_mbit = link_mbit
        self.burst_kb = burst_kb
        self.tag = tag or uuid.uuid4().hex[:5]
        if len(self.tag) > 6:
            raise ValueError(f"tag must be at most 6 characters (interface names are limited to 15), got {tag!r}")
        # One /24 per emulation, picked from the tag, so two emulations do not share addresses.
        self.subnet = f"10.{200 + int(self.tag, 16) % 50}.{int(self.tag, 16) % 250}"
        self.bridge = f"sa{self.tag}br"
        self.created: list[tuple[str, str]] = []

    def namespace(self, node: int) -> str:
        return f"sa{self.tag}-n{node}"

    def interface(self, node: int) -> str:
        """The node's interface inside its namespace (what ``GLOO_SOCKET_IFNAME`` names)."""
        return f"sa{self.tag}n{node}"

    def host_interface(self, node: int) -> str:
        return f"sa{self.tag}h{node}"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node)]

    def node_env(self, node: int) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": self.interface(node), "MASTER_ADDR": self.address(0)}

    def setup(self) -> None:
        check_netns_support()
        try:
            self._run("link", "add", self.bridge, "type", "bridge")
            self.created.append(("link", self.bridge))
            self._run("link", "set", self.bridge, "up")
            for node in range(self.num_nodes):
                ns, inner, outer = self.namespace(node), self.interface(node), self.host_interface(node)
                self._run("netns", "add", ns)
                self.created.append(("netns", ns))
                self._run("link", "add", outer, "type", "veth", "peer", "name", inner)
                self.created.append(("link", outer))
                self._run("link", "set", inner, "netns", ns)
                self._run("link", "set", outer, "master", self.bridge)
                self._run("link", "set", outer, "up")
                self._run("-n", ns, "link", "set", "lo", "up")
                self._run("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", inner)
                self._run("-n", ns, "link", "set", inner, "up")
                if self.link_mbit is not None:
                    self._tbf([], outer)  # towards the node
                    self._tbf(["ip", "netns", "exec", ns], inner)  # out of the node
        except BaseException:
            self.teardown()
            raise
        log.info("emulated network %s: %d nodes, link %s Mbit/s", self.tag, self.num_nodes, self.link_mbit or "inf")

    def teardown(self) -> None:
        """Remove everything this instance created (namespaces take their veth ends with them). Idempotent."""
        for kind, name in reversed(self.created):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self.created.clear()

    def counters(self) -> list[dict[str, int]]:
        """Bytes each node has moved so far, from the kernel's interface counters: ``link_tx``/``link_rx`` on its
        link to the other nodes, ``lo_tx``/``lo_rx`` between its own processes (loopback: each byte counted once
        sent, once received). Headers included: what the wire carried, not what the collectives were handed."""
        import json

        out = []
        for node in range(self.num_nodes):
            row: dict[str, int] = {}
            for name, dev in (("link", self.interface(node)), ("lo", "lo")):
                res = _ip("-n", self.namespace(node), "-s", "-j", "link", "show", "dev", dev, check=False)
                stats = json.loads(res.stdout)[0]["stats64"] if res.returncode == 0 and res.stdout.strip() else {}
                row[f"{name}_tx"] = int(stats.get("tx", {}).get("bytes", 0))
                row[f"{name}_rx"] = int(stats.get("rx", {}).get("bytes", 0))
            out.append(row)
        return out

    def leftovers(self) -> list[str]:
        """Namespaces and links of this instance that still exist (empty after a clean teardown)."""
        ns = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        return [w.split("@")[0].rstrip(":") for w in (ns + links).split() if w.startswith(f"sa{self.tag}")]

    def set_link(self, mbit: float | None) -> None:
        """Re-rate every node's link, both directions, while the job runs (``None``: no limit). What another job's
        traffic on a shared link does to this one, on a schedule (``EmulatedCluster(link_schedule=...)``)."""
        if mbit is not None and not mbit > 0:
            raise ValueError(f"mbit must be > 0 (or None for no limit), got {mbit}")
        self.link_mbit = mbit
        for node in range(self.num_nodes):
            ns = self.namespace(node)
            for prefix, dev in (([], self.host_interface(node)), (["ip", "netns", "exec", ns], self.interface(node))):
                if mbit is None:
                    subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
                else:
                    self._tbf(prefix, dev, verb="replace")

    def _tbf(self, prefix: list[str], dev: str, verb: str = "add") -> None:
        cmd = [*prefix, "tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{self.link_mbit}mbit",
               "burst", f"{self.burst_kb}kb", "latency", "500ms"]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise EmulationUnavailable(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")

    def _run(self, *args: str) -> None:
        res = _ip(*args, check=False)
        if res.returncode != 0:
            raise EmulationUnavailable(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")
