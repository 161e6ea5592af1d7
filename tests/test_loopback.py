"""free_port: a port below the kernel's ephemeral range, free when handed out."""

from __future__ import annotations

import socket

import pytest

from kvshare import loopback
from kvshare.loopback import ephemeral_start, free_port


def test_the_port_lies_below_the_ephemeral_range_and_binds():
    for _ in range(20):
        port = free_port()
        assert loopback.LOWEST <= port < ephemeral_start()
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # raises if something holds it


def test_a_held_port_is_never_handed_out(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    with held:
        # the only candidate below the range is the held port, so the kernel chooses instead
        monkeypatch.setattr(loopback, "LOWEST", port)
        monkeypatch.setattr(loopback, "ephemeral_start", lambda: port + 1)
        assert free_port() != port


@pytest.mark.parametrize("text", ["", "garbage", "40000"])
def test_an_unreadable_range_falls_back_to_linux_default(tmp_path, monkeypatch, text):
    monkeypatch.setattr(loopback, "EPHEMERAL_RANGE", tmp_path / "range")
    if text:
        (tmp_path / "range").write_text(text + "\t60999\n" if text == "40000" else text)
    assert ephemeral_start() == (40000 if text == "40000" else 32768)
