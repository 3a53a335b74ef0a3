"""One small HTTP server per node for what operators read: `/metrics` (Prometheus text format) always, `/healthz`
and `/readyz` for supervisors where the node says how to answer them (`health.py`), and where the node watches the
swarm, `/` (the dashboard page) and `/api/swarm` (the JSON it polls).

Standard library only (`ThreadingHTTPServer` in a daemon thread): nothing here is on the training path, and a
slow or hostile client costs one thread for at most `REQUEST_TIMEOUT_S`, never a round; past `MAX_CONNECTIONS` at
once, a new connection is closed unanswered. Everything served is read-only, on loopback unless the operator says
otherwise (`--metrics-host`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from hetero_node.client.monitor.health import Check, Health
from hetero_node.client.monitor.node_metrics import NAMESPACE
from hetero_node.client.monitor.swarm_watch import SwarmWatcher
from hetero_node.protocol.errors import ConfigError

logger = logging.getLogger(__name__)
Route = Callable[[], tuple[HTTPStatus, str, bytes]]
"""(status, content type, body) of a GET."""
TEXT = "text/plain; charset=utf-8"
REQUEST_TIMEOUT_S = 10.0
"""A connection that sends no complete request for this long is closed (300 idle ones once held 300 threads)."""
MAX_CONNECTIONS = 32
"""Connections served at once; Prometheus, a supervisor and a few dashboards need a handful."""


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them: one more is closed at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            logger.debug("monitor: %d connections open; closing one from %s", self.max_connections, client_address[0])
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def dashboard_page() -> bytes:
    return files("hetero_node.client.monitor").joinpath("dashboard.html").read_bytes()


def probe(check: Check) -> Route:
    """A health check as a route: 200 or 503 (Service Unavailable, what supervisors and load balancers expect), and
    the check's line as the body."""

    def route() -> tuple[HTTPStatus, str, bytes]:
        ok, why = check()
        return (HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE), TEXT, f"{why}\n".encode()

    return route


class MonitorServer:
    """Serves `registry` at /metrics, with `health` /healthz and /readyz, with a `watcher` the dashboard; `close()`
    stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        watcher: SwarmWatcher | None = None,
        health: Health | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        routes: dict[str, Route] = {"/metrics": lambda: (HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(registry))}
        if health is not None:
            routes["/healthz"] = probe(health.healthz)
            routes["/readyz"] = probe(health.readyz)
        if watcher is not None:
            page = dashboard_page()
            routes["/"] = lambda: (HTTPStatus.OK, "text/html; charset=utf-8", page)
            routes["/api/swarm"] = lambda: (HTTPStatus.OK, "application/json", json.dumps(watcher.state()).encode())
        try:
            self.httpd = BoundedHTTPServer((host, port), _handler(routes, request_timeout_s), max_connections)
        except OSError as e:
            raise ConfigError(f"could not serve metrics on {host}:{port}: {e}") from None
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="monitor-http", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def open_dashboard(
    host: str, port: int, read: Callable[[], dict[str, Any] | None], health: Health | None = None
) -> Iterator[MonitorServer]:
    """The dashboard and the swarm gauges, from snapshots `read` returns (polled in a thread), while in the block."""
    watcher = SwarmWatcher(read).start()
    registry = CollectorRegistry()
    ProcessCollector(namespace=NAMESPACE, registry=registry)
    registry.register(watcher)
    try:
        server = MonitorServer(host, port, registry, watcher, health)
        try:
            yield server
        finally:
            server.close()
    finally:
        watcher.close()


def _handler(routes: dict[str, Route], request_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout_s  # on the socket: a silent client is dropped, its thread freed

        def do_GET(self) -> None:
            route = routes.get(self.path.split("?", 1)[0])
            if route is None:
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            status, content_type, body = route()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: not for the log
            logger.debug("%s " + format, self.client_address[0], *args)

    return Handler
