"""A test auth server speaking nsqd's --auth-http-address protocol (used by the TLS/AUTH and client tests)."""

import http.server
import json
import threading
import urllib.parse

import pytest


class AuthServer:
    """nsqd's auth server protocol: GET /auth?remote_ip=&tls=&secret=&common_name= (or a POST of the same
    values as JSON lists) answered with {"ttl", "identity", "identity_url", "authorizations"}."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, bytes]] = {}
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, params: dict) -> None:
                with server.lock:
                    server.requests.append({"method": self.command, "path": urllib.parse.urlparse(self.path).path,
                                            "params": params, "accept": self.headers.get("Accept"),
                                            "content_type": self.headers.get("Content-Type")})
                    status, body = server.answers.get(params.get("secret"), (200, json.dumps(
                        {"ttl": 60, "identity": "nobody", "authorizations": []}).encode()))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query, keep_blank_values=True)
                self._answer({k: v[0] for k, v in query.items()})

            def do_POST(self) -> None:
                raw = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._answer({k: v[0] for k, v in raw.items()})

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def allow(self, secret: str, authorizations: list[dict], *, ttl: int = 3600, identity: str = "") -> None:
        body = {"ttl": ttl, "identity": identity or secret, "identity_url": f"http://id.example/{secret}",
                "authorizations": authorizations}
        self.answers[secret] = (200, json.dumps(body).encode())

    def answer(self, secret: str, status: int, body: bytes) -> None:
        self.answers[secret] = (status, body)

    def count(self, secret: str) -> int:
        with self.lock:
            return sum(1 for r in self.requests if r["params"].get("secret") == secret)

    def last(self, secret: str) -> dict:
        with self.lock:
            return [r for r in self.requests if r["params"].get("secret") == secret][-1]


@pytest.fixture
def authd():
    server = AuthServer()
    server.thread.start()
    server.allow("rw", [{"topic": "^orders", "channels": [".*"], "permissions": ["publish", "subscribe"]}])
    server.allow("pub-only", [{"topic": ".*", "channels": [".*"], "permissions": ["publish"]}])
    server.allow("sub-only", [{"topic": "^orders$", "channels": ["^billing$"], "permissions": ["subscribe"]}])
    server.allow("none", [])
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()
