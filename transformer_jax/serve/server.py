"""The listening socket, bound before anything is loaded (a busy port fails at once), and
``DrainingServer``: uvicorn's server that drains the runner on SIGTERM and exits 0."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger("transformer_jax.serve")

#: Seconds uvicorn waits after the grace period for the aborted requests' last chunks.
ABORT_MARGIN_S = 5.0


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` and listening (port 0: a free one).

    Raises:
      OSError: the address cannot be had, named (``[Errno 98]`` for a port in use).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host {host!r} is not an address this machine has: {e}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's TIME_WAIT
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def is_loopback(sock: socket.socket) -> bool:
    """Whether ``sock`` is bound to a loopback address only (not 0.0.0.0, ::, or another
    interface's)."""
    address = sock.getsockname()[0]
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def url_of(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (IPv6 in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains the runner on SIGTERM/SIGINT and exits 0.

    Args:
      runner: the ``EngineRunner`` (its ``drain`` is called on the first signal).
      config: uvicorn's config; its ``timeout_graceful_shutdown`` is the grace period before
        requests in flight are aborted (uvicorn's own becomes that plus ``ABORT_MARGIN_S``).
      on_started: called once uvicorn is serving (after the socket is handed over).
    """

    def __init__(self, runner: Any, config: uvicorn.Config,
                 on_started: Callable[[], None] | None = None) -> None:
        self.grace = max(0.0, config.timeout_graceful_shutdown or 0.0)
        config.timeout_graceful_shutdown = self.grace + ABORT_MARGIN_S
        super().__init__(config)
        self.runner = runner
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Starts the runner's grace period, then uvicorn's shutdown."""
        self.runner.drain(self.grace)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """On a signal: flags only (a signal handler may run inside a lock's critical
        section on this thread); ``shutdown`` does the rest."""
        if self.should_exit:  # a second signal: stop waiting, abort now
            self.force_exit = True
            self.runner.abort_at = 0.0
            return
        self.should_exit = True
        self.runner.draining = True
        logger.info("signal %d: draining (grace %g s)", sig, self.grace)
