"""The HTTP endpoint: GET /metrics in Prometheus' text format, on a thread per connection.
http.server rather than prometheus_client's start_http_server, whose signature and return value
differ between Debian 12 (0.16, returns nothing) and Ubuntu 24.04 (0.19), so it could not be stopped."""

from __future__ import annotations

import http.server
import socket
import threading

from prometheus_client import CollectorRegistry, exposition


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry):
        self._registry = registry
        registry_ = registry

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self._reply(404, b"only /metrics is served here\n", "text/plain; charset=utf-8")
                    return
                try:
                    body = exposition.generate_latest(registry_)
                except Exception as exc:  # a collector bug: the scrape fails, the coordinator does not
                    self._reply(500, f"collecting the metrics failed: {exc!r}\n".encode(), "text/plain; charset=utf-8")
                    return
                self._reply(200, body, exposition.CONTENT_TYPE_LATEST)

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes every few seconds would flood the journal
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = Server((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> "MetricsServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
