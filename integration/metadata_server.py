"""A small HTTP metadata server speaking Mooncake's http metadata protocol, so no Mooncake install is needed.

Protocol (the one of Mooncake's ``mooncake_http_metadata_server``): one path, ``/metadata``, with the key in the
query string ``?key=<key>``:

* ``PUT /metadata?key=K`` with any body stores the body under K (200); a second PUT of a key containing
  ``rpc_meta`` is refused with 400, as Mooncake's server does;
* ``GET /metadata?key=K`` returns the stored body (200) or 404;
* ``DELETE /metadata?key=K`` removes it (200) or 404;
* no ``key``: 400.

Values are opaque bytes: pxn engines and Mooncake engines can share one server (pxn keeps its entries under keys
starting with ``pxn/``). Start it from a shell with ``python -m integration.metadata_server --port 8080`` or in a
program::

    from integration.metadata_server import MetadataServer
    with MetadataServer("127.0.0.1", 0) as srv:      # port 0: any free port
        url = srv.url                                # "http://127.0.0.1:<port>/metadata"
"""
from __future__ import annotations

import argparse
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

__all__ = ["MetadataServer", "main"]

_MAX_BODY = 64 << 20  # bytes; a segment description is a few KB


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # through logging, not stderr
        log.debug("%s - %s", self.address_string(), fmt % args)

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _key(self) -> Optional[str]:
        url = urlsplit(self.path)
        if url.path.rstrip("/") != "/metadata":
            self._reply(404, b"unknown path")
            return None
        key = parse_qs(url.query).get("key", [""])[0].strip()
        if not key:
            self._reply(400, b"metadata key is required")
            return None
        return key

    def do_GET(self):  # noqa: N802 — http.server's naming
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            value = self.server.store.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value)

    def do_PUT(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if not 0 <= n <= _MAX_BODY:
            self._reply(400, b"bad Content-Length")
            return
        body = self.rfile.read(n)
        with self.server.lock:
            if "rpc_meta" in key and key in self.server.store:
                dup = True
            else:
                dup = False
                self.server.store[key] = body
        if dup:
            self._reply(400, b"Duplicate rpc_meta key not allowed")
        else:
            self._reply(200, b"metadata updated")

    do_POST = do_PUT

    def do_DELETE(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            found = self.server.store.pop(key, None) is not None
        self._reply(200 if found else 404, b"metadata deleted" if found else b"metadata not found")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr):
        super().__init__(addr, _Handler)
        self.store: Dict[str, bytes] = {}
        self.lock = threading.Lock()


class MetadataServer:
    """The server on ``host``:``port`` (0: any free port), served from a background thread.

    ``url`` is what engines pass as ``metadata_server`` to ``initialize``. ``close()`` stops it (idempotent).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8080):
        self._srv = _Server((host, port))
        self.host = host
        self.port = self._srv.server_address[1]
        self._thread = threading.Thread(target=self._srv.serve_forever, name=f"pxn-metadata-{self.port}",
                                        daemon=True)
        self._thread.start()
        log.info("metadata server on %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metadata"

    def keys(self):
        """The keys stored now (diagnostics, tests)."""
        with self._srv.lock:
            return sorted(self._srv.store)

    def close(self) -> None:
        if self._thread is not None:
            self._srv.shutdown()
            self._srv.server_close()
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m integration.metadata_server",
                                 description="HTTP metadata server compatible with Mooncake's (GET/PUT/DELETE "
                                             "/metadata?key=...)")
    ap.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    ap.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    srv = MetadataServer(args.host, args.port)
    print(f"metadata server listening on {srv.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
