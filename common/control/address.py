"""HOST:PORT addresses of control servers: parsing, writing, and the address a server
advertises to peers on other hosts (a wildcard bind is reached through the host's name)."""

from __future__ import annotations

import socket

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
SUPERVISOR_CONTROL_ENV = "LOSSGUARD_SUPERVISOR_CONTROL"
"""Set by a supervisor serving TCP for the command it runs: its advertised HOST:PORT."""


def split_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as host and port; ValueError names what is wrong."""
    host, _, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() for c in host) or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 10.0.0.5:9420)")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def public_host(bind_host: str) -> str:
    """The host name to give peers for a server bound to ``bind_host``."""
    return socket.gethostname() if bind_host in WILDCARD_HOSTS else bind_host


def advertised_address(bound: tuple[str, int], advertise: str | None) -> str:
    """What a server listening on ``bound`` (its socket's address) tells peers to dial:
    ``advertise`` when given, else the bound address with a wildcard host replaced by the
    host's name."""
    if advertise is not None:
        return advertise
    return join_address(public_host(bound[0]), bound[1])
