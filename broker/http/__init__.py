"""nsqd's HTTP API (nsqd/http.go), served by shared/http_server's HTTP/1.1 loop inside the broker's nursery.

Files: endpoints (Api: one method per endpoint), serve (the routes, the Site, TLS), openapi
(/openapi.json).

- ``serve``: nsqd's routes (httprouter's dispatch, shared/http_api.Router) as a shared/http_server
  ``Site`` on --http-address and --https-address; with --tls-required the plain port answers every
  request 403 TLS_REQUIRED, as nsqd's ServeHTTP.
- ``Api``: one method per endpoint, free of any framework. It takes a ``Request`` (method, query
  string, Content-Length and a body reader that stops at a cap) and returns a ``Reply``. Parameters,
  checks, their order, status codes and messages are nsqd's, so nsqadmin, nsq_stat, nsq_to_http and every
  client library keep working.

Request bodies are never taken whole before their size is known to be allowed: a declared
Content-Length over the limit is refused before reading, and a body streamed without one is read only up
to the limit. The rest is read and dropped before the 413 goes out (within LINGER_SECONDS and
LINGER_BYTES; beyond them the answer goes out and the connection closes), so that a client still
uploading sees the answer instead of a reset, and the connection stays usable.
"""
