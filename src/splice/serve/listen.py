"""The server's listening sockets, bound before the model loads.

Loading a model and allocating its KV cache take a while; a ``--host`` that does not resolve or a ``--port`` in use
is refused first, in one line naming it. The bound sockets are then handed to uvicorn (:class:`Server`), so the
server listens on the very port that was checked. They are bound, not listening, while the model loads: a client
that connects meanwhile is refused at once rather than left waiting. A bound socket keeps the port from other binds,
except (on Linux) from another server's socket that also sets ``SO_REUSEADDR``: two such sockets may share a port
until one listens, and the second to listen then fails, which :class:`Server` reports as uvicorn reports a port in
use.
"""
from __future__ import annotations

import logging
import socket
import sys

import uvicorn

#: uvicorn's logger for its own lifecycle lines ("Uvicorn running on ...").
log = logging.getLogger("uvicorn.error")
#: The status uvicorn exits with when it cannot start.
STARTUP_FAILURE = 3


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address ``host`` resolves to, as uvicorn binds them itself (``SO_REUSEADDR``; IPv6
    sockets IPv6-only, so an IPv4 one beside them can take the same port). Port 0 takes a free port, the same on
    every address. Raises ``ValueError`` naming the host and port."""
    sockets: list[socket.socket] = []
    try:
        for family, address in addresses(host, port):
            if sockets and port == 0:  # the port the first address got, for the others too
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sockets.append(bound(family, address))
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise ValueError(f"the server cannot listen on {where(host, port)}: {error.strerror or error}; allowed: a "
                         "free port (or 0 for any free one) on an address of this machine") from None
    return sockets


def addresses(host: str, port: int) -> list[tuple[int, tuple]]:
    """The distinct (family, socket address) pairs ``host`` resolves to; "" means every interface, as in asyncio."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ValueError(f"--host {host!r} is neither an address nor a name that resolves ({reason}); allowed: an "
                         "address or host name of this machine, e.g. 127.0.0.1 (this machine alone) or 0.0.0.0 "
                         "(every interface)") from None
    return list(dict.fromkeys((family, address) for family, _, _, _, address in found))


def bound(family: int, address: tuple) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def where(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{where(host, port)}"


class Server(uvicorn.Server):
    """uvicorn's server on sockets bound beforehand (:func:`bind`). uvicorn logs where it listens only for sockets it
    binds itself; this logs it for these, once it listens."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        except OSError as error:  # listen() failed: another server's socket took the port after bind
            log.error("cannot listen on %s: %s", ", ".join(url(sock) for sock in sockets or ()), error)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        for sock in sockets or ():
            log.info("Uvicorn running on %s (Press CTRL+C to quit)", url(sock))
