"""The address a worker advertises to the scheduler (services.worker.__main__.advertised_address):
every wildcard bind host is replaced by the machine's name. "[::]" and "" were not (only "0.0.0.0"
and "::" were): `--host [::]` advertised "[::]:port", which the scheduler dials as its own machine."""

from __future__ import annotations

import pytest

from services.worker.__main__ import advertised_address


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_host_advertises_the_machine_name(host: str) -> None:
    assert advertised_address(host, 50061, hostname="node-7") == "node-7:50061"


@pytest.mark.parametrize("host,expected", [
    ("10.0.0.5", "10.0.0.5:50061"),
    ("fd00::5", "[fd00::5]:50061"),  # an IPv6 literal is bracketed
    ("[fd00::5]", "[fd00::5]:50061"),
    ("worker.local", "worker.local:50061"),
])
def test_a_specific_host_is_advertised_as_bound(host: str, expected: str) -> None:
    assert advertised_address(host, 50061, hostname="node-7") == expected


def test_an_explicit_advertise_address_wins() -> None:
    assert advertised_address("[::]", 50061, "fd00::9:7000", hostname="node-7") == "[fd00::9]:7000"
    assert advertised_address("0.0.0.0", 50061, "w1:7000", hostname="node-7") == "w1:7000"
