"""The coordinator's OpenAI-compatible HTTP API (``--http-port``):
``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed as
server-sent events or not, ``GET /v1/models``, ``GET /health`` and
``GET /version``, on uvicorn in the coordinator's event loop. Requests are
validated by the same :class:`outrider.coordinator.requests.RequestBuilder` as gRPC
requests and run by the same round loop; errors are OpenAI's error object.

* ``schemas``: the request bodies; ``app``: the routes and the translation
  of a body into the coordinator's request parameters; ``generation``: a
  request's run and its answer (JSON or events); ``errors``: statuses and
  error objects; ``server``: uvicorn in the running event loop.
"""

from .app import create_app
from .server import HttpServer, start_http_server

__all__ = ["HttpServer", "create_app", "start_http_server"]
