"""The side channel: a producer worker's ZMQ server and a consumer's client.

The server is poll-driven (the producer's owner calls `poll()` from its loop, so no
extra thread touches state). With a shared token both ends speak ZMQ CURVE: the
server's keypair derives from the token (`auth.curve_server_secret`), each client
uses its instance's key pair (`identity.Identity`) or an ephemeral one, so every byte
after ZMQ's greeting is encrypted and a peer without the token cannot complete the
handshake (its messages never reach us). The server learns each client's public key
from the handshake (ZMQ's authenticator, ZAP) and gives it to its handler (`peer_key`).
Each request is one frame (see `messages.py`); a
malformed, oversized, unknown-kind or unauthenticated frame is answered with
`Refused`, logged with its reason, and the server goes on serving other peers.
ZMQ's own MAXMSGSIZE (a multiple of the limit) bounds what it buffers from a peer
that tries to stream more; such a peer is disconnected by ZMQ itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable

import zmq
from zmq.auth import CURVE_ALLOW_ANY
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvbridge.transfer.auth import curve_server_secret
from kvbridge.transfer.errors import AuthError, HandshakeError, ProtocolError
from kvbridge.transfer.identity import Identity
from kvbridge.transfer.messages import Message, Refused, decode, encode

log = logging.getLogger("kvbridge.transfer.side_channel")

#: A handler maps a request, and the ZMQ routing id of the peer that sent it (what
#: `SideChannelServer.send_to` takes), to its reply (None: no reply).
Handler = Callable[[Message, bytes], Message | None]

_context: zmq.Context[zmq.Socket[bytes]] | None = None
_authenticator: ThreadAuthenticator | None = None


def _ctx() -> zmq.Context[zmq.Socket[bytes]]:
    global _context
    if _context is None:
        _context = zmq.Context()
    return _context


def start_io_threads() -> None:
    """Start this process's ZMQ I/O and reaper threads now (libzmq starts them with a
    context's first socket), so that they are made by whoever calls this: a worker's
    connector, whose threads keep their CPU priority when the compute lowers its own
    (`kvbridge.engine.cpu_share`); made later by the compute's thread, they would
    inherit its lower priority and carry the heartbeats and notifications behind it."""
    _ctx().socket(zmq.PAIR).close(linger=0)


def _start_authenticator() -> None:
    """Run ZMQ's authenticator (ZAP) for this process's context once: it admits every
    CURVE client (the server key, from the token, already keeps out non-holders) and
    names each connection by its client's public key, which the server hands to its
    handler (`SideChannelServer.peer_key`) to check an instance id bound to a key."""
    global _authenticator
    if _authenticator is None:
        auth = ThreadAuthenticator(_ctx(), log=logging.getLogger("kvbridge.transfer.zap"))
        auth.start()
        auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
        _authenticator = auth


def _unbounded_monitor(sock: zmq.Socket[bytes], events: int) -> zmq.Socket[bytes]:
    """A socket that receives `sock`'s connection events, with no limit on how many wait.

    ZMQ's I/O thread writes monitor events with a blocking send: with pyzmq's
    `get_monitor_socket` (1,000 messages each side) a monitored client whose events go
    unread for a while (a peer that accepts and drops it ten times a second, nobody
    asking `is_connected`) blocks that thread, the only one of the process's context,
    and every side channel in the process stops connecting. Unlimited here, and drained
    at each use of the client."""
    addr = f"inproc://kvbridge-monitor-{os.urandom(8).hex()}"
    sock.monitor(addr, events)
    pair = _ctx().socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.setsockopt(zmq.RCVHWM, 0)  # set before connect: the inproc pipe takes it then
    pair.connect(addr)
    return pair


def _close_client_sockets(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes] | None) -> None:
    """Close a client's socket and its monitor: monitoring stopped first (ZMQ closes its
    sending end), then the monitor's receiving end, then the socket. ZMQ's I/O thread
    writes each connection event to the monitor with a blocking send: with the
    receiving end closed first while the socket still retried a refused connection, the
    next event blocked that thread, the process's only one, and every side channel in
    the process stopped (a client collected unclosed could go in either order)."""
    if monitor is not None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
    sock.close(linger=0)


def _peer_address(frame: zmq.Frame) -> str | None:
    """The network address a received frame came from (ZMQ's "Peer-Address")."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:  # a transport without one
        return None


def curve_server_keys(token: bytes) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys of every producer side channel, Z85-encoded."""
    secret = z85.encode(curve_server_secret(token))
    return zmq.curve_public(secret), secret


class SideChannelServer:
    """A ROUTER socket serving typed requests; owned and polled by one thread.

    Guarantees: never raises on a bad peer message; every rejection is logged at
    WARNING with its reason and counted in `num_rejected`.
    """

    def __init__(
        self, host: str, port: int, token: bytes | None, max_bytes: int, handler: Handler
    ) -> None:
        self._token = token
        self._max_bytes = max_bytes
        self._handler = handler
        self._sock = _ctx().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_bytes)
        # a client that reconnects (a link that healed) keeps its routing id: its new
        # connection takes over the old one, so `send_to` reaches it again
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        #: the CURVE public key (Z85) of the client whose message the handler is given
        #: now (None without a token: no key is authenticated)
        self.peer_key: bytes | None = None
        #: the network address of the current request's sender (its handler's to read)
        self.peer_address: str | None = None
        if token is not None:
            _start_authenticator()
            public, secret = curve_server_keys(token)
            self._sock.curve_publickey, self._sock.curve_secretkey = public, secret
            self._sock.curve_server = True
            self._sock.zap_domain = b"kvbridge"
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                self._sock.bind(f"tcp://{host}:*")
        except zmq.ZMQError as exc:
            self._sock.close()
            raise HandshakeError(
                f"side channel cannot bind tcp://{host}:{port or '*'}: {exc}; "
                "choose a free port (or base_port=0 for any)"
            ) from None
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_served = 0
        self.num_rejected = 0

    def poll(self, timeout_ms: int = 0, max_messages: int = 64) -> int:
        """Serve up to `max_messages` waiting requests; returns how many were handled."""
        handled = 0
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return 0
        while handled < max_messages:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            handled += 1
            if len(frames) > 1:
                self.peer_address = _peer_address(frames[1])
                if self._token is not None:
                    self.peer_key = str(frames[1].get("User-Id")).encode()
            self._serve([f.bytes for f in frames])
            self.peer_key = self.peer_address = None
        return handled

    def _serve(self, frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[1:]
        try:
            if len(payload) != 1:
                raise ProtocolError(f"request has {len(payload)} frames; send exactly one")
            request = decode(payload[0], self._token, self._max_bytes)
            reply = self._handler(request, identity)
        except Exception as exc:  # never let one peer's message stop the server
            if not isinstance(exc, ProtocolError):
                log.exception("side channel %s: handler failed", self.endpoint)
                exc = ProtocolError(f"internal error handling the request: {exc}")
            self.num_rejected += 1
            kind = "auth" if isinstance(exc, AuthError) else "protocol"
            log.warning(
                "side channel %s: rejected a request from peer %s: %s",
                self.endpoint,
                identity.hex(),
                exc,
            )
            reply = Refused(kind=kind, reason=str(exc))
        else:
            self.num_served += 1
        if reply is not None:
            self._sock.send_multipart([identity, encode(reply, self._token)])

    def send_to(self, peer: bytes, msg: Message) -> None:
        """Send `msg` unasked to the client whose routing id is `peer` (as the handler
        was given it). Never blocks or raises: ZMQ drops it if that client is not
        connected now (its waiter's own timeout or liveness bound then applies)."""
        try:
            self._sock.send_multipart([peer, encode(msg, self._token)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning(
                "side channel %s: cannot send to peer %s: %s", self.endpoint, peer.hex(), exc
            )

    def close(self) -> None:
        self._sock.close(linger=0)


class SideChannelClient:
    """A DEALER connection to one producer worker; one outstanding request at a time.

    `send` then `try_recv` (non-blocking) lets a consumer's poll loop wait without
    blocking; `call` is the blocking form with a timeout. Once a handshake is done the
    server may send unasked messages too (`ReadAck`), read with `try_recv`. A request that timed out
    leaves the socket unusable (a late reply could answer the next request), so
    `reset` reconnects before the next one.

    With `liveness_timeout_s`, ZMQ heartbeats the connection (ZMTP PING every fifth of
    it, answered by the peer's ZMQ I/O thread, however busy the peer's owner is) and
    drops it when nothing came back for that long; `is_connected` says whether it is up.
    """

    def __init__(
        self,
        endpoint: str,
        token: bytes | None,
        max_bytes: int,
        liveness_timeout_s: float | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._token = token
        self._identity = identity
        self._max_bytes = max_bytes
        self._liveness_ms = int(liveness_timeout_s * 1000) if liveness_timeout_s else 0
        # one routing id for every connection this client makes, so that a server's
        # unasked messages (`send_to`) still reach it after ZMQ reconnected
        self.routing_id = b"kv" + os.urandom(14)
        self._monitor: zmq.Socket[bytes] | None = None
        self._closer: weakref.finalize[..., SideChannelClient] | None = None
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = _ctx().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self._max_bytes)
        if self._liveness_ms:
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, self._liveness_ms // 5))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._liveness_ms)
            self._monitor = _unbounded_monitor(
                sock,
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED,
            )
        self._connected = self._lost = False
        # when the peer's host first refused a connection, if no connection was ever made
        self._refused_since: float | None = None
        if self._token is not None:
            sock.curve_serverkey = curve_server_keys(self._token)[0]
            if self._identity is not None:  # the instance's own key: its id names it
                sock.curve_publickey = self._identity.public
                sock.curve_secretkey = self._identity.secret
            else:
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        # closed in the safe order by `close`, or when this client is collected unclosed:
        # the finalizer holds both sockets, so neither is collected before it runs
        self._closer = weakref.finalize(self, _close_client_sockets, sock, self._monitor)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self._closer()
            raise HandshakeError(
                f"endpoint={self.endpoint!r} is not a usable side-channel address ({exc}); "
                "expected tcp://HOST:PORT"
            ) from None
        return sock

    def send(self, msg: Message) -> None:
        self._sock.send(encode(msg, self._token), zmq.NOBLOCK)

    def try_recv(self) -> Message | None:
        """The reply if one arrived, else None; raises ProtocolError on a bad reply."""
        self._drain_monitor()
        try:
            data = self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return decode(data, self._token, self._max_bytes)

    def call(self, msg: Message, timeout_s: float) -> Message:
        """Send `msg` and wait for the reply; raises HandshakeError after `timeout_s`."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                if time.monotonic() >= deadline:
                    self.reset()
                    raise HandshakeError(
                        f"no answer from {self.endpoint} within {timeout_s:g} s; "
                        "is the producer worker running, the endpoint right, and the "
                        "shared token the same on both sides?"
                    )
                continue
            reply = self.try_recv()
            if reply is not None:
                return reply

    @property
    def is_lost(self) -> bool:
        """Whether the connection was up and went down since (heartbeats unanswered for
        `liveness_timeout_s`, or closed by the peer) and has not come back; False while
        it is first being made. Always False without `liveness_timeout_s`."""
        self._drain_monitor()
        return self._lost

    @property
    def is_refused(self) -> bool:
        """Whether the peer's host has refused this client's connections for
        `liveness_timeout_s` and none was ever made: nothing listens on that port any
        more (its process is gone), so waiting longer for an answer is pointless. A peer
        that does not answer at all (a cut link, a stopped process) is not refused: its
        waiter's own timeout applies. Always False without `liveness_timeout_s`."""
        self._drain_monitor()
        since = self._refused_since
        return since is not None and time.monotonic() - since >= self._liveness_ms / 1000

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up, as far as ZMQ knows: handshaken and not dropped
        since (its heartbeats unanswered for `liveness_timeout_s`, or closed by the
        peer); ZMQ reconnects by itself. Always True without `liveness_timeout_s`."""
        self._drain_monitor()
        return self._connected or self._monitor is None

    def _drain_monitor(self) -> None:
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
                self._connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                self._lost = event == zmq.EVENT_DISCONNECTED
                self._refused_since = None
            elif (  # refused before any connection was made (then one of those two holds)
                event == zmq.EVENT_CONNECT_RETRIED
                and not (self._connected or self._lost)
                and self._refused_since is None
            ):
                self._refused_since = time.monotonic()

    def reset(self) -> None:
        self.close()
        self._sock = self._connect()

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
        self._monitor = None
