"""The address a fault-tolerant node advertises to the others: where they reach its store, its torchft manager, the
checkpoint server a joiner heals from, and the sockets of the rounds' exchange (issue 65: ``torchrun --standalone``
sets ``MASTER_ADDR`` to a loopback address, and a node that advertised it sent the others to their own localhost)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from urllib.parse import urlparse

__all__ = ["FT_HOST_ENV", "advertised_host", "choose_host"]

FT_HOST_ENV = "SYNCASYNC_FT_HOST"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return address == "localhost"


def choose_host(explicit: str | None, hostname: str, hostname_addresses: Sequence[str], route_address: str | None,
                lighthouse_host: str) -> str:  # fmt: skip
    """The address this node advertises to the others, from what the machine reports (:func:`advertised_host`).

    In order: ``SYNCASYNC_FT_HOST``; else the first address of the hostname that is this machine's own and not a
    loopback (a cluster's usual answer, and torchrun's); else the address this machine reaches the Lighthouse from
    (the interface the other nodes' traffic arrives on: the right one when ``/etc/hosts`` maps the hostname to
    127.0.0.1, as containers and network namespaces do). A loopback address is only ever advertised when the
    Lighthouse itself is on loopback, i.e. every node is on this machine (``syncasync-train ft=2``).

    Why not ``MASTER_ADDR``: ``torchrun --standalone`` (and Lightning's own launcher) set it to a loopback address,
    which is right for the ranks inside the node and wrong for the other nodes: a node that advertised it sent the
    others to their own localhost (issue 65)."""
    remote = not _is_loopback(lighthouse_host)
    if explicit:
        if _is_loopback(explicit) and remote:
            raise ValueError(
                f"{FT_HOST_ENV}={explicit!r} is a loopback address, but the Lighthouse is at {lighthouse_host}: the "
                f"other nodes cannot reach this node there. HINT: set {FT_HOST_ENV} to this node's address on the "
                f"network the nodes share, or unset it (the address this node reaches the Lighthouse from is used)"
            )
        return explicit
    for address in hostname_addresses:
        if not _is_loopback(address):
            return address
    if route_address and not _is_loopback(route_address):
        return route_address
    if not remote:
        return "127.0.0.1"
    raise ValueError(
        f"no address of this node that the other nodes can reach: the hostname {hostname!r} resolves only to "
        f"loopback ({', '.join(hostname_addresses) or 'nothing'}), MASTER_ADDR is a launcher's loopback address, "
        f"{FT_HOST_ENV} is unset, and the route to the Lighthouse at {lighthouse_host} leaves from "
        f"{route_address or 'nowhere'}. HINT: export {FT_HOST_ENV}=<this node's address> on every node (and "
        "GLOO_SOCKET_IFNAME=<its interface> for the ranks inside the node), or map the hostname to that address"
    )


def advertised_host(lighthouse: str) -> str:
    """:func:`choose_host` from this machine's facts: ``SYNCASYNC_FT_HOST``, the hostname's addresses that can be
    bound here (an ``/etc/hosts`` entry of another machine is not this node's), and the source address of the route
    to the Lighthouse (a UDP ``connect``: no packet is sent)."""
    parsed = urlparse(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    lh_host, lh_port = parsed.hostname or "", parsed.port or 29510
    name = socket.gethostname()
    own: list[str] = []
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
        except OSError:
            continue
        if address not in own:
            own.append(address)
    route = None
    try:
        family = socket.getaddrinfo(lh_host, lh_port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])
            route = str(probe.getsockname()[0])
    except OSError:
        pass
    lh_address = lh_host
    try:
        lh_address = socket.getaddrinfo(lh_host, None)[0][4][0]
    except OSError:
        pass
    return choose_host(os.environ.get(FT_HOST_ENV), name, own, route, str(lh_address))
