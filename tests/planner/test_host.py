"""This host's resources: a free port."""

from __future__ import annotations

import socket

from pipeplan.planner.host import free_port


def test_free_port_can_be_listened_on_and_differs_from_one_in_use() -> None:
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert free_port() != port
