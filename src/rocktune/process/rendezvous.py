"""Several nodes meet before torchrun starts: a preflight in the launching process, bounded in time.

Left to torchrun, a node whose peer never comes waits out the static rendezvous (900 s), the supervisor restarts it
and it waits again; a ``--master-port`` already taken ends in a traceback after a run directory was made. Here, with
a static master (``--master-addr``), node 0 first checks that the port is free, then listens on it until every other
node has said hello; each other node says hello there and waits for node 0's answer. All of it within
``reliability.rendezvous_timeout_s`` (``--rendezvous-timeout``), said at start; a failure is one paragraph naming
the port or the nodes that did not come, and nothing is written. Only then is the port handed to torchrun, whose own
rendezvous gets the same bound. Sockets only: the launching process (the supervisor) stays without torch.

A c10d rendezvous (``--rdzv-endpoint HOST:PORT``) gets the same checks where they apply: torchrun starts its store
on the machine that HOST names, so there the port must be free (one node; with several, a busy port may be a peer's
store), and elsewhere HOST must resolve and the port answer within the same bound.
"""

from __future__ import annotations

from collections.abc import Callable

import errno
import socket
import time

from rocktune.errors import UserError
from rocktune.train.request import Launch

HELLO = b"rocktune-node "  # + node rank + newline
GO = b"go\n"
RETRY_S = 0.5  # between connection attempts of a node waiting for node 0


def preflight(launch: Launch, timeout_s: float, say=print) -> None:
    """Raise a ``UserError`` unless this node's rendezvous can form within ``timeout_s``; torch-free."""
    if launch.rdzv_endpoint:  # c10d: then torchrun's own join_timeout bounds the rendezvous (torchrun_args)
        _endpoint_preflight(launch, timeout_s, say)
        return
    if launch.nnodes == 1:
        if launch.master_addr:  # --master-port honoured on one node
            _listener(launch).close()
        return
    say(f"rendezvous: node {launch.node_rank} of {launch.nnodes}, master {launch.master_addr}:{launch.master_port}; "
        f"waiting up to {timeout_s:g} s for the other nodes (reliability.rendezvous_timeout_s, "
        "--rendezvous-timeout)")
    if launch.node_rank == 0:
        _gather(launch, timeout_s)
    else:
        _join(launch, timeout_s)


def _endpoint_preflight(launch: Launch, timeout_s: float, say) -> None:
    host, port = _split_endpoint(launch.rdzv_endpoint)
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError as exc:
        raise UserError(f"--rdzv-endpoint {launch.rdzv_endpoint}: the host {host} cannot be resolved on this machine "
                        f"({exc.strerror or exc}); nothing was started or written. Give the name or address of the "
                        "machine that hosts the rendezvous, as this machine can reach it.") from None
    if addresses & _own_addresses():
        if launch.nnodes == 1:
            _listener(Launch(launch.nproc, 1, 0, host, port), flag="--rdzv-endpoint").close()
        return
    say(f"rendezvous: c10d at {host}:{port}, node {launch.node_rank} of {launch.nnodes}; waiting up to "
        f"{timeout_s:g} s for it to answer (reliability.rendezvous_timeout_s, --rendezvous-timeout)")
    last = _retry(timeout_s, lambda left: socket.create_connection((host, port), timeout=min(left, 10.0)).close())
    if last is None:
        return
    raise UserError(f"--rdzv-endpoint {host}:{port} did not answer within {timeout_s:g} s ({last}); this is node "
                    f"{launch.node_rank} of {launch.nnodes}, and nothing was started or written. Start the run on "
                    f"the machine {host} first (its torchrun hosts the rendezvous), check that this machine can reach "
                    "it on that port (firewall), or give it longer with --rendezvous-timeout SECONDS.")


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")  # an IPv6 address is written [::1]:29400
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--rdzv-endpoint {endpoint}: expected HOST:PORT (e.g. head-node:29400), the machine that "
                        "hosts the rendezvous and a port between 1 and 65535.")
    return host, int(port)


def _own_addresses() -> set[str]:
    """This machine's addresses as torchrun tells whether it hosts the store: loopback, its name's addresses."""
    own = {"127.0.0.1", "::1"}
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            own |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            continue
    return own


def _listener(launch: Launch, flag: str = "--master-port") -> socket.socket:
    """The port, bound as torch's store will bind it; ``flag``: the option that named it, for the error."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds it: TIME_WAIT is no use
    named = f"--master-port {launch.master_port}" if flag == "--master-port" else \
        f"{flag} {launch.master_addr}:{launch.master_port}: port {launch.master_port}"
    fix = "with --master-port (the same on every node)" if flag == "--master-port" else f"in {flag}"
    try:
        sock.bind(("", launch.master_port))
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            why = "is already in use" if exc.errno == errno.EADDRINUSE else "may not be used by this user"
            raise UserError(f"{named} {why} on this machine (node 0), so the processes cannot meet there; nothing "
                            f"was started or written. Choose a free port {fix}, or stop what holds it (`ss -ltnp` "
                            "shows it).") from None
        raise UserError(f"{named} cannot be opened on this machine ({exc.strerror}); choose another {fix}.") from None
    sock.listen(max(8, launch.nnodes))
    return sock


def _gather(launch: Launch, timeout_s: float) -> None:
    """Node 0: every other node's hello, then go to all. Peers close first, so the port is free again for torchrun
    at once (the side that closes first keeps the TIME_WAIT)."""
    deadline = time.monotonic() + timeout_s
    expected = set(range(1, launch.nnodes))
    peers: dict[int, socket.socket] = {}
    with _listener(launch) as server:
        try:
            while set(peers) != expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UserError(_missing(launch, sorted(expected - set(peers)), timeout_s))
                server.settimeout(left)
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                rank = _hello_rank(conn, min(5.0, max(left, 0.1)))
                if rank in expected and rank not in peers:
                    peers[rank] = conn
                else:
                    conn.close()  # a stranger on the port, or a node rank given twice
            for conn in peers.values():
                conn.sendall(GO)
            for conn in peers.values():
                conn.settimeout(5.0)
                try:
                    conn.recv(1)  # the peer closes after reading go
                except OSError:
                    pass
        finally:
            for conn in peers.values():
                conn.close()


def _hello_rank(conn: socket.socket, timeout_s: float) -> int | None:
    conn.settimeout(timeout_s)
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < 64:
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    if not data.startswith(HELLO):
        return None
    try:
        return int(data[len(HELLO):].strip())
    except ValueError:
        return None


def _retry(timeout_s: float, attempt: Callable[[float], str | None]) -> str | None:
    """Calls ``attempt(seconds left)`` every RETRY_S until it returns None (done) or ``timeout_s`` have passed; then
    returns why the last attempt failed (its string, "timed out", or the socket error)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        try:
            last = attempt(left)
            if last is None:
                return None
        except TimeoutError:
            last = "timed out"
        except OSError as exc:
            last = exc.strerror or str(exc)
        time.sleep(min(RETRY_S, max(deadline - time.monotonic(), 0)))
    return last


def _join(launch: Launch, timeout_s: float) -> None:
    """Node > 0: hello to node 0 until it answers go, within the bound."""
    def hello(left: float) -> str | None:
        with socket.create_connection((launch.master_addr, launch.master_port), timeout=min(left, 10.0)) as conn:
            conn.sendall(HELLO + f"{launch.node_rank}\n".encode())
            conn.settimeout(max(left, 0.1))
            if conn.recv(len(GO)) == GO:
                return None
            return "node 0 closed the connection (is something else listening on that port?)"

    last = _retry(timeout_s, hello)
    if last is None:
        return
    raise UserError(f"node 0 at {launch.master_addr}:{launch.master_port} did not answer within {timeout_s:g} s "
                    f"({last}); this is node {launch.node_rank} of {launch.nnodes}. Start node 0 (`rocktune train "
                    "... --node-rank 0`) with the same --master-addr and --master-port, check that this machine can "
                    "reach it (firewall), or give it longer with --rendezvous-timeout SECONDS.")


def _missing(launch: Launch, missing: list[int], timeout_s: float) -> str:
    nodes = ", ".join(map(str, missing))
    return (f"node(s) {nodes} of {launch.nnodes} did not join within {timeout_s:g} s at {launch.master_addr}:"
            f"{launch.master_port}; nothing was started or written. On each of them run the same `rocktune train` "
            "with its own --node-rank and the same --master-addr and --master-port, check that they can reach "
            "this machine on that port (firewall), or wait longer with --rendezvous-timeout SECONDS.")
