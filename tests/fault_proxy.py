"""A loopback TCP proxy between tfde and a real redis-server that injects
faults into the server's replies, for tests.

The proxy counts the RESP replies it forwards from the server to its
clients (all connections together, in the order it forwards them) and,
at a chosen position of that count, applies a fault to the reply there:

  * ``"close"``: close the connection (both sides) instead of forwarding it;
  * ``"drop"``: swallow it and every later reply of that connection, leaving
    the connection open (a server that stopped answering: the client times
    out; TCP itself never loses one reply and delivers the next);
  * ``("delay", seconds)``: forward it late;
  * ``"corrupt"``: forward it with its type byte replaced by one RESP does
    not have, a framing error a correct client must notice;
  * ``"-CODE text"`` (any string starting with "-"): send that error reply
    in its place (the command itself ran on the server).

It also counts the commands clients send, and cut() makes one never reach
the server: the connection carrying it is closed right before it (the
commands pipelined ahead of it are forwarded), and new connections are
refused (accepted and closed) until heal(), as if the server died between
two commands of a pipeline.

Usage::

    with FaultProxy(server_port) as proxy:
        config = {"redis_host_port": proxy.port, ...}
        ...
        proxy.inject("-LOADING Redis is loading", at=2)  # the third reply from now
        ...
        assert proxy.injected == 1

Traffic stays on 127.0.0.1.
"""

import socket
import threading
import time

_LINE_TYPES = b"+-:_#,("  # RESP2 and RESP3 types that are one line
_BULK_TYPES = b"$!="  # a length line, then that many bytes
_AGGREGATES = {b"*": 1, b"~": 1, b">": 1, b"%": 2}  # n elements (a map: n pairs)


def reply_end(buf: bytes, pos: int = 0):
    """End (exclusive) of the RESP2 / RESP3 reply (or command: an array of
    bulk strings) starting at buf[pos], or None while it is incomplete.  An
    attribute ("|") is taken with the reply it annotates."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind, body = buf[pos : pos + 1], buf[pos + 1 : line_end]
    end = line_end + 2
    if kind in _LINE_TYPES:
        return end
    if kind in _BULK_TYPES:
        n = int(body)
        if n < 0:
            return end
        return end + n + 2 if len(buf) >= end + n + 2 else None
    if kind in _AGGREGATES or kind == b"|":
        n = int(body)
        for _ in range(max(n, 0) * (1 if kind in b"*~>" else 2)):
            end = reply_end(buf, end)
            if end is None:
                return None
        return reply_end(buf, end) if kind == b"|" else end
    raise ValueError(f"not a RESP reply: {buf[pos : pos + 20]!r}")


class FaultProxy:
    """See the module docstring.  Thread-safety: inject() may be called from
    any thread; faults apply in the order the proxy forwards replies."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._faults = {}  # reply number (since the start) -> fault
        self.replies = 0  # replies seen so far (forwarded or faulted)
        self.requests = 0  # commands seen so far (forwarded or cut)
        self._cut_at = None  # command number to cut at
        self._refusing = False  # after a cut, until heal()
        self.injected = 0  # faults applied so far
        self.connections = 0  # client connections accepted so far
        self._sockets = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def inject(self, fault, at: int = 0) -> None:
        """Applies `fault` to the reply `at` replies from now (0: the next)."""
        if not (
            fault in ("close", "drop", "corrupt")
            or (isinstance(fault, str) and fault.startswith("-"))
            or (isinstance(fault, tuple) and fault[0] == "delay")
        ):
            raise ValueError(f"unknown fault {fault!r}")
        with self._lock:
            self._faults[self.replies + at] = fault

    def cut(self, at: int = 0) -> None:
        """The command `at` commands from now (0: the next) never reaches the
        server; from then on the server is unreachable until heal()."""
        with self._lock:
            self._cut_at = self.requests + at

    def heal(self) -> None:
        """Accepts connections again and forgets a cut not applied yet."""
        with self._lock:
            self._cut_at = None
            self._refusing = False

    @property
    def was_cut(self) -> bool:
        with self._lock:
            return self._refusing

    def clear(self) -> None:
        """Forgets faults not applied yet."""
        with self._lock:
            self._faults.clear()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._faults)

    def close(self) -> None:
        self._closed = True
        for s in [self._listener, *self._sockets]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ plumbing

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
            if refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self.connections += 1
                self._sockets += [client, server]
            threading.Thread(target=self._pump_requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump_replies, args=(server, client), daemon=True).start()

    @staticmethod
    def _shut(*socks):
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _pump_requests(self, client, server):
        buf = b""
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                buf += data
                out = b""
                while buf:
                    end = reply_end(buf)  # a command is a RESP array of bulk strings
                    if end is None:
                        break
                    with self._lock:
                        cut = self._cut_at == self.requests
                        self.requests += 1
                        if cut:
                            self._cut_at, self._refusing = None, True
                    if cut:  # the server "dies": every connection closes
                        server.sendall(out)
                        with self._lock:
                            everyone = list(self._sockets)
                        self._shut(client, server, *everyone)
                        return
                    out, buf = out + buf[:end], buf[end:]
                server.sendall(out)
        except (OSError, ValueError):  # ValueError: not RESP; nothing sensible to forward
            pass
        self._shut(client, server)

    def _pump_replies(self, server, client):
        buf = b""
        dropping = False
        try:
            while True:
                data = server.recv(65536)
                if not data:
                    break
                buf += data
                while buf:
                    end = reply_end(buf)
                    if end is None:
                        break
                    reply, buf = buf[:end], buf[end:]
                    with self._lock:
                        fault = self._faults.pop(self.replies, None)
                        self.replies += 1
                        if fault is not None:
                            self.injected += 1
                    if dropping or fault == "drop":
                        dropping = True
                        continue
                    if fault == "close":
                        self._shut(client, server)
                        return
                    if isinstance(fault, tuple):
                        time.sleep(fault[1])
                    elif fault == "corrupt":
                        reply = b"?" + reply[1:]
                    elif isinstance(fault, str):
                        reply = fault.encode() + b"\r\n"
                    client.sendall(reply)
        except (OSError, ValueError):  # ValueError: not RESP; nothing sensible to forward
            pass
        self._shut(client, server)
