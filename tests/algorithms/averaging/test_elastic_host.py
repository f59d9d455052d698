"""The address a fault-tolerant node advertises to the others (issue 65: ``torchrun --standalone`` sets
``MASTER_ADDR`` to loopback, and a node that advertised it sent the others to their own localhost)."""

from __future__ import annotations

import os
import socket
from unittest import mock

import pytest

from lightning_syncasync.algorithms.averaging.ft_host import advertised_host, choose_host


@pytest.mark.parametrize(
    ("explicit", "hostname_addresses", "route", "lighthouse", "chosen"),
    [
        ("10.0.0.5", ["10.1.1.1"], "10.2.2.2", "10.9.9.9", "10.0.0.5"),  # SYNCASYNC_FT_HOST wins
        (None, ["127.0.1.1", "10.1.1.1"], "10.2.2.2", "10.9.9.9", "10.1.1.1"),  # the hostname's own, not loopback
        (None, ["127.0.0.1"], "10.2.2.2", "10.9.9.9", "10.2.2.2"),  # /etc/hosts maps it to loopback: the route
        (None, ["::1"], "fd00::2", "fd00::9", "fd00::2"),
        (None, ["127.0.0.1"], "127.0.0.1", "127.0.0.1", "127.0.0.1"),  # every node on this machine (ft=2)
        (None, [], None, "localhost", "127.0.0.1"),
    ],
)
def test_the_advertised_address_is_never_loopback_unless_the_lighthouse_is(
    explicit, hostname_addresses, route, lighthouse, chosen
):
    assert choose_host(explicit, "node", hostname_addresses, route, lighthouse) == chosen


def test_on_this_machine_a_remote_lighthouse_gets_an_address_of_this_machine_it_can_be_reached_at():
    # The hostname of this machine resolves to 127.0.0.1 in many containers; the route towards a (made-up) remote
    # Lighthouse leaves from a real interface whatever the hostname says. No packet is sent.
    with mock.patch.dict(os.environ, {"SYNCASYNC_FT_HOST": ""}):
        try:
            host = advertised_host("http://192.0.2.10:29510")
        except ValueError as err:  # a machine with no route off loopback at all: the refusal names the fix
            assert "SYNCASYNC_FT_HOST" in str(err)
            return
    assert not host.startswith("127.") and host != "::1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))  # an address of this machine, not another one's /etc/hosts entry
