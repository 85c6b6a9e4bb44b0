"""The websocket server of openpi's policy protocol, as openpi's `WebsocketPolicyServer` speaks it
to its `WebsocketClientPolicy` (openpi: src/openpi/serving/websocket_policy_server.py,
packages/openpi-client/src/openpi_client/websocket_client_policy.py):

    on connect   the server sends the policy's metadata, one msgpack-numpy message (wire.py)
    then, each   the client sends an observation (a msgpack-numpy map); the server answers
                 {"actions": float32 [H, D_a], "server_timing": {"infer_ms": ...,
                 "prev_total_ms": ...}} (prev_total_ms from the second request on: the previous
                 request's time from waiting for it to its answer sent, as openpi measures it)
    on an error  a text frame (a bad observation or message: the one-line reason; anything else:
                 that it failed and the error's number, the traceback only in the server's log:
                 never code, paths or values to a remote client), then the server closes that
                 connection (1008 for bad input, 1011 otherwise); other connections are served on
    GET /healthz 200 "OK"

Requests are sampled by one worker thread, one call at a time (the model has one device), while
the event loop goes on reading: by default one request a call, as openpi's server answers them;
with `Limits.max_batch` > 1 (`zerojax serve --max-batch N`), the requests waiting when the worker
turns to them, from different connections, are sampled in one call (each with its own request's
noise: the same actions as one at a time). With an API key, a connection
without openpi's header `Authorization: Api-Key KEY` is refused (401) before the handshake.
Messages above the policy's `max_message_bytes` close the connection (1009). No client can stall
the others or hold the server's memory (`Limits`): a handshake must finish within 10 s, a
connection that stops answering keepalive pings is closed, two frames at most are buffered per
connection, and past `max_connections` a new one is refused (503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import http
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass

import websockets
from websockets.asyncio import server as ws_server
from websockets.frames import CloseCode

from zerojax.serve import wire
from zerojax.serve.observation import ObservationError

log = logging.getLogger("zerojax.serve")
BAD_INPUT = (ObservationError, wire.WireError)


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the server. A robot's policy must never stall because of
    another connection: a half-open socket, a client that stops reading or answering, one that
    sends a frame a byte at a time, or a crowd of connections."""

    open_timeout_s: float = 10.0  # the handshake must complete within this (a bare TCP connect is dropped)
    ping_interval_s: float = 20.0  # a keepalive ping every this many seconds ...
    ping_timeout_s: float = 20.0  # ... its pong due within this, else the connection is closed (half-open)
    close_timeout_s: float = 5.0  # a closing handshake waits at most this long
    max_queue: int = 2  # frames buffered per connection (a robot sends one request, then waits)
    max_connections: int = 64  # connections served at once; more get 503 until one closes
    max_batch: int | None = None  # requests sampled in one call at most (None: the policy's max_batch, else 1)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, taken before the model is loaded, so that a port in use
    is said at once (OSError) rather than after compiling; PolicyServer(sock=) serves on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server
        sock.bind((host, port))
        sock.listen(100)
    except OSError:
        sock.close()
        raise
    return sock


class PolicyServer:
    """Serves `policy` (anything with `metadata()`, `max_message_bytes` and `infer(obs, n)`) on
    host:port (0: a free port; `port` is the bound one once serving). It counts the requests
    (n = 0, 1, ... over its life, all connections together): the policy's noise is drawn from n."""

    def __init__(self, policy, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 sock: socket.socket | None = None, limits: "Limits | None" = None):
        self.policy, self.host, self.port, self.api_key, self.sock = policy, host, port, api_key, sock
        self.limits = limits or Limits()
        self._open = 0  # connections past their handshake, being served
        # a policy that batches checks each observation as it comes (prepare) and samples the rows
        # that arrived together in one call (infer_rows); any other is asked one at a time
        self._max_batch = self.limits.max_batch or getattr(policy, "max_batch", 1)
        self._prepare = getattr(policy, "prepare", lambda obs: obs)
        self._infer_rows = getattr(policy, "infer_rows", None) or (
            lambda rows, requests: [policy.infer(obs, n) for obs, n in zip(rows, requests)])
        self._metadata = wire.pack(policy.metadata())
        self._requests = itertools.count()
        self._failures = itertools.count(1)
        self._loop = self._server = self._thread = None

    def serve_forever(self, on_ready=None) -> None:
        """Serve in this thread until interrupted; `on_ready(port)` once listening."""
        asyncio.run(self._serve(on_ready))

    def start(self) -> int:
        """Serve in a background thread; returns the bound port once listening."""
        ready, failed = threading.Event(), []

        def run():
            try:
                asyncio.run(self._serve(lambda port: ready.set()))
            except BaseException as err:  # noqa: BLE001 - handed to the caller of start()
                failed.append(err)
                ready.set()

        self._thread = threading.Thread(target=run, name="zerojax-serve", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self.port

    def stop(self) -> None:
        """Close the server started by `start` (and its connections) and wait for its thread."""
        self._loop.call_soon_threadsafe(self._server.close)
        self._thread.join()

    async def _serve(self, on_ready) -> None:
        where = {"sock": self.sock} if self.sock is not None else {"host": self.host, "port": self.port}
        lim = self.limits
        async with ws_server.serve(self._handler, **where, compression=None, max_size=self.policy.max_message_bytes,
                                   process_request=self._process_request, open_timeout=lim.open_timeout_s,
                                   ping_interval=lim.ping_interval_s, ping_timeout=lim.ping_timeout_s,
                                   close_timeout=lim.close_timeout_s, max_queue=lim.max_queue) as server:
            self._loop, self._server = asyncio.get_running_loop(), server
            self.port = server.sockets[0].getsockname()[1]
            self._queue = asyncio.Queue()
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerojax-sample") as self._worker:
                sampler = asyncio.create_task(self._sample())
                if on_ready is not None:
                    on_ready(self.port)
                try:
                    await server.serve_forever()
                finally:
                    sampler.cancel()

    def _process_request(self, connection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if self._open >= self.limits.max_connections:
            log.warning("refused %s: %d connections open (--max-connections)", connection.remote_address, self._open)
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"this server is serving its {self.limits.max_connections} connections; "
                                      "try again later\n")
        if self.api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Api-Key {self.api_key}".encode()):
                log.warning("refused %s: no valid Authorization: Api-Key header", connection.remote_address)
                return connection.respond(http.HTTPStatus.UNAUTHORIZED,
                                          "this server needs the header Authorization: Api-Key KEY\n")
        return None

    async def _handler(self, connection) -> None:
        self._open += 1
        try:
            await self._serve_connection(connection)
        finally:
            self._open -= 1

    async def _serve_connection(self, connection) -> None:
        try:
            await connection.send(self._metadata)
        except websockets.ConnectionClosed:
            return
        prev_total_s = None
        while True:
            start = time.monotonic()
            try:
                message = await connection.recv()
            except websockets.ConnectionClosed:
                return
            try:
                row = self._prepare(wire.unpack(message))  # a bad observation fails here, alone
                done = asyncio.get_running_loop().create_future()
                self._queue.put_nowait((row, next(self._requests), done))
                reply, infer_s = await done
                timing = {"infer_ms": infer_s * 1e3}
            except Exception as err:  # noqa: BLE001 - any failure ends this connection, never the server
                await self._refuse(connection, err)
                return
            if prev_total_s is not None:
                timing["prev_total_ms"] = prev_total_s * 1e3
            try:
                await connection.send(wire.pack({**reply, "server_timing": timing}))
            except websockets.ConnectionClosed:
                return
            prev_total_s = time.monotonic() - start

    async def _sample(self) -> None:
        """The one consumer of the request queue: the requests waiting when it turns to them (up to
        `Limits.max_batch`) are sampled in one call, in a worker thread, so the event loop goes on
        reading, answering pings and queueing while the model runs; one call at a time (one device)."""
        loop = asyncio.get_running_loop()
        while True:
            waiting = [await self._queue.get()]
            while len(waiting) < self._max_batch and not self._queue.empty():
                waiting.append(self._queue.get_nowait())
            rows, requests, futures = map(list, zip(*waiting))
            start = time.monotonic()
            try:
                replies = await loop.run_in_executor(self._worker, self._infer_rows, rows, requests)
            except Exception as err:  # noqa: BLE001 - each of its requests is answered with it
                replies = err
            elapsed = time.monotonic() - start
            for i, done in enumerate(futures):
                if done.done():  # its connection went away meanwhile
                    continue
                if isinstance(replies, Exception):
                    done.set_exception(replies)
                else:
                    done.set_result((replies[i], elapsed))

    async def _refuse(self, connection, err: Exception) -> None:
        """The error as a text frame, then that connection closed (openpi's server does the same)."""
        if isinstance(err, BAD_INPUT):
            log.warning("%s: %s", connection.remote_address, err)
            text, code, reason = str(err), CloseCode.POLICY_VIOLATION, "bad observation, see the previous frame"
        else:  # the traceback stays in the server's log: a remote client sees no code, path or value
            number = next(self._failures)
            log.error("%s: inference failed (error %d)", connection.remote_address, number, exc_info=err)
            text = f"the policy failed on this observation (error {number} in the server's log)"
            code, reason = CloseCode.INTERNAL_ERROR, "internal server error, see the previous frame"
        try:
            await connection.send(text)
            await connection.close(code=code, reason=reason)
        except websockets.ConnectionClosed:
            pass
