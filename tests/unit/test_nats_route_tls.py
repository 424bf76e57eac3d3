"""With TLS for clients, a NATS cluster's routes are TLS too: each member requires the other's
certificate, signed by the stack's CA, and a route dialled without one is refused."""

import re
import socket
import ssl

from services.stack.servers import start_nats_cluster
from services.stack.tls import server_tls


def _route_port(server) -> int:
    cluster = server.conf_file.read_text().split("cluster {", 1)[1]
    return int(re.search(r'listen: "[^"]*:(\d+)"', cluster).group(1))


def test_a_cluster_with_tls_forms_over_tls_routes_and_refuses_a_plain_route(tmp_path):
    tls = server_tls(tmp_path / "tls", ["127.0.0.1", "localhost"])
    servers = start_nats_cluster(tmp_path / "nats", 3, password="secret", tls=tls)  # waits for a JetStream leader
    try:
        port = _route_port(servers[0])
        # a member's certificate opens the route (the route's INFO comes over TLS); without a client
        # certificate the handshake is refused, and a route dialled in the clear hears nothing
        with_cert = ssl.create_default_context(cafile=str(tls.ca_file))
        with_cert.load_cert_chain(str(tls.cert_file), str(tls.key_file))
        without = ssl.create_default_context(cafile=str(tls.ca_file))
        assert _first_line(port, with_cert).startswith(b"INFO ")
        assert isinstance(_first_line(port, without), (ssl.SSLError, OSError))
        assert _first_line(port, None) == b""
    finally:
        for server in servers:
            server.stop()


def _first_line(port: int, context: ssl.SSLContext | None) -> bytes | Exception:
    """The first line the route port sends (over TLS with ``context``, else in the clear, where
    b"" means nothing within a second), or the error that ended the attempt."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            if context is None:
                raw.settimeout(1)
                try:
                    return raw.recv(64)
                except TimeoutError:
                    return b""
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
                conn.settimeout(5)
                line = conn.makefile("rb").readline()
                return line if line else ConnectionError("closed")
        except (ssl.SSLError, OSError) as exc:
            return exc
