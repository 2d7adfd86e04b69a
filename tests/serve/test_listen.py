"""The server's sockets, bound before the model loads: refusals naming the host or port, and uvicorn serving on
them (a one-route app in this process)."""
from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from splice.serve.listen import Server, bind


def test_port_0_binds_a_free_port_that_is_kept():
    [sock] = bind("127.0.0.1", 0)
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # the socket holds the port
    finally:
        sock.close()


def test_every_interface_gets_one_port_on_each_address():
    sockets = bind("", 0)
    try:
        assert len({sock.getsockname()[1] for sock in sockets}) == 1
        assert {sock.family for sock in sockets} >= {socket.AF_INET}
    finally:
        for sock in sockets:
            sock.close()


def test_a_busy_port_is_refused_naming_host_and_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError) as refused:
            bind("127.0.0.1", port)
    assert str(refused.value).startswith(f"the server cannot listen on 127.0.0.1:{port}: ")
    assert "allowed: a free port (or 0 for any free one)" in str(refused.value)


@pytest.mark.parametrize("host", ["256.1.1.1", "a" * 64])
def test_a_host_that_does_not_resolve_is_refused_naming_it(host):
    with pytest.raises(ValueError, match=f"--host '{host}' is neither an address nor a name that resolves"):
        bind(host, 0)


def test_a_non_local_address_is_refused():
    with pytest.raises(ValueError, match="cannot listen on 192.0.2.1:0: Cannot assign requested address"):
        bind("192.0.2.1", 0)  # TEST-NET-1: an address no machine here has


async def hello(scope, receive, send):
    """A one-route ASGI app: 200 "hello" (lifespan events accepted)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


def test_uvicorn_serves_on_the_bound_socket_and_says_where(caplog):
    sockets = bind("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    server = Server(uvicorn.Config(hello, host="127.0.0.1", port=0, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    with caplog.at_level(logging.INFO, "uvicorn.error"):
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "hello"
        finally:
            server.should_exit = True
            thread.join(30)
    assert f"Uvicorn running on http://127.0.0.1:{port} (Press CTRL+C to quit)" in caplog.text
    assert sockets[0].fileno() == -1  # uvicorn closed it at shutdown


def test_a_port_taken_between_bind_and_listen_ends_as_uvicorn_ends_on_a_busy_port(caplog):
    sockets = bind("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    with socket.socket() as thief:  # another server that binds with SO_REUSEADDR too, and listens first
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", port))
        thief.listen()
        server = Server(uvicorn.Config(hello, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
        with pytest.raises(SystemExit) as exit_:
            server.run(sockets=sockets)
    assert exit_.value.code == 3 and f"cannot listen on http://127.0.0.1:{port}" in caplog.text
    sockets[0].close()
