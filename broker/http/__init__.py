"""nsqd's HTTP API (nsqd/http.go) as a quart-trio app, served by hypercorn inside the broker's nursery.

Files: request (ApiRequest), endpoints (Api: one method per endpoint), app (the Quart app and its
routing), front (the ASGI front and its hot routes), serve (hypercorn, TLS), openapi (/openapi.json).

Three layers, outermost first:

- ``Front``, the ASGI callable hypercorn is given: refuses plain HTTP with 403 TLS_REQUIRED when TLS is
  required (as nsqd's ServeHTTP), and serves the two hot routes, ``POST /pub`` and ``POST /mpub``, itself
  straight from ASGI events; everything else goes to the Quart app. A Quart request costs several times
  what the publish does (request/response objects, context variables, a nursery per request), so the
  routes whose rate matters skip it. The Quart app has the same two routes, so it is complete on its own.
- the ``QuartTrio`` app from ``create_app``: httprouter's dispatch (shared/http_api.Router) over nsqd's
  routes: nsqd's JSON 404/405/500 and its trailing-slash and fixed-path redirects.
- ``Api``: one method per endpoint, free of any framework. It takes an ``ApiRequest`` (method, query
  string, Content-Length and a body reader that stops at a cap) and returns a ``Reply``. Parameters,
  checks, their order, status codes and messages are nsqd's, so nsqadmin, nsq_stat, nsq_to_http and every
  client library keep working.

Request bodies are never taken whole before their size is known to be allowed: a declared
Content-Length over the limit is refused before reading, and a body streamed without one is read only up
to the limit. The rest is read and dropped before the 413 goes out (within LINGER_SECONDS and
LINGER_BYTES; beyond them the answer goes out and the connection closes), because
hypercorn closes a connection whose request body is unfinished when the answer ends, and a client still
uploading would then see a reset instead of the answer; this way the connection even stays usable.
"""
