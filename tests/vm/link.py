"""The cluster's subnet between the guests: one Ethernet segment, a hub on the host's loopback.

Each guest's VPC NIC is a QEMU socket netdev in UDP mode: it sends every frame to its own port of
the hub (`join`) from a port the kernel picks for QEMU, and receives on that port. The hub learns
that port from the guest's first frame (a guest says something as its interface comes up: DHCP is
off, but IPv6's router solicitation and duplicate-address probe go out at once) and copies every
frame it gets from one guest to every other guest it has heard from. That is a hub, not a switch:
three or four guests make a few frames a second on this link (the routers' health checks, requests
of a few hundred bytes), so flooding costs nothing. Any number of guests share it, so a surge's
replacement can run beside the instance it replaces, as it does in a subnet. No port is chosen
here and handed to QEMU later: the hub's own ports are bound before QEMU starts and held, and
QEMU's are bound by QEMU.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class Hub:
    """A learning-free Ethernet hub over UDP on 127.0.0.1, running in a thread of the harness."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._ports: dict[int, socket.socket] = {}  # the hub's port for a guest -> its socket
        self._peers: dict[int, tuple[str, int]] = {}  # the hub's port for a guest -> where that guest's QEMU listens
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="vm-hub", daemon=True)
        self._thread.start()

    def join(self) -> int:
        """A new port of the hub for one guest's NIC (QEMU's `udp=127.0.0.1:<port>`)."""
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        port = int(s.getsockname()[1])
        with self._lock:
            self._ports[port] = s
        self._sel.register(s, selectors.EVENT_READ, port)
        self._wake_w.send(b"x")
        return port

    def leave(self, port: int) -> None:
        """A guest is gone: its frames stop, and none are sent to it."""
        with self._lock:
            s = self._ports.pop(port, None)
            self._peers.pop(port, None)
        if s is not None:
            self._sel.unregister(s)
            s.close()

    def stop(self) -> None:
        self._stopped = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=10)
        for port in list(self._ports):
            self.leave(port)

    def _run(self) -> None:
        while not self._stopped:
            for key, _ in self._sel.select(timeout=1):
                if key.data is None:
                    self._wake_r.recv(4096)
                    continue
                try:
                    frame, sender = key.fileobj.recvfrom(65536)  # type: ignore[union-attr]
                except OSError:  # a guest that went away (its port refused a copy): nothing to read
                    continue
                with self._lock:
                    self._peers[key.data] = sender
                    copies = [(self._ports[p], addr) for p, addr in self._peers.items() if p != key.data and p in self._ports]
                for s, addr in copies:
                    with contextlib.suppress(OSError):  # a guest powered off: its copy is lost, as on a wire
                        s.sendto(frame, addr)
