"""Simulated hosts for tests: network namespaces (``ip netns``), each joined to this machine by a
veth pair, with an address of its own. A process started in one (``Host.argv``) listens on that
address; this machine (the monitor's and Prometheus's host) reaches it there, as it would a
training node. Needs root and Debian's iproute2 (scripts/setup.sh installs it)."""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

_uses = itertools.count()


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace and its address."""

    namespace: str
    address: str

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside the host."""
        return ["ip", "netns", "exec", self.namespace, *command]


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts for the duration: host i is 10.S.i.2, reached from here through
    10.S.i.1, with S chosen per process so that concurrent test workers never share a
    subnet. Removed on exit (the kernel frees a namespace's links in the background, so each
    use has names of its own)."""
    tag = f"{os.getpid() % 100_000}{next(_uses) % 10}"
    subnet = 200 + os.getpid() % 50
    made: list[Host] = []
    links: list[str] = []
    try:
        for i in range(1, count + 1):
            namespace, outside, inside = f"lg{tag}h{i}", f"lg{tag}v{i}", f"lg{tag}w{i}"
            _ip("netns", "add", namespace)
            made.append(Host(namespace, f"10.{subnet}.{i}.2"))
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            links.append(outside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("addr", "add", f"10.{subnet}.{i}.1/24", "dev", outside)
            _ip("link", "set", outside, "up")
            _ip("-n", namespace, "addr", "add", f"10.{subnet}.{i}.2/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
        yield made
    finally:
        for link in links:  # deleting one end of a pair deletes both, and the address here
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        for host in made:
            subprocess.run(["ip", "netns", "del", host.namespace], check=False)
