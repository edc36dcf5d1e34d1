"""A real S3 server for tests: moto's server mode over HTTP on 127.0.0.1, in a thread.

``S3Server`` serves moto's S3 with a hook called on every request (to act at a precise
moment, say the third part of an upload), which may have the server answer an error
(``ErrorReply``) or cut its reply short and drop the connection (``CutReply``). The tests
put ``aiockpt.storage.testing.Relay`` in front of it for a server that stops and comes back,
moto's state living on behind it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import WSGIRequestHandler, make_server

KEY = "testing"
SECRET = "testing"


class _QuietHandler(WSGIRequestHandler):
    def log(self, type: str, message: str, *args: Any) -> None:
        pass


class ErrorReply(Exception):
    """Raised by an ``on_request`` hook: the server answers with this S3 error instead."""

    def __init__(self, status: int, code: str = "InternalError") -> None:
        super().__init__(status, code)
        self.status, self.code = status, code


class CutReply(Exception):
    """Raised by an ``on_request`` hook: the server sends moto's reply with its status, its
    headers (the full Content-Length among them) and only the first ``keep`` bytes of its body,
    then closes the connection, as a server that dies or a network that drops mid-reply."""

    def __init__(self, keep: int) -> None:
        super().__init__(keep)
        self.keep = keep


class DropReply(Exception):
    """Raised by an ``on_request`` hook: moto carries the request out, then the connection
    closes before a byte of the reply is sent, as an answer lost on the way back."""


class S3Server:
    """moto's S3 at ``endpoint``; ``on_request(environ)`` sees every request first."""

    def __init__(self) -> None:
        self._app = DomainDispatcherApplication(create_backend_app)
        self.on_request: Callable[[dict[str, Any]], None] | None = None
        self._server = make_server(
            "127.0.0.1", 0, self._wsgi, threaded=True, request_handler=_QuietHandler
        )
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _wsgi(self, environ: dict[str, Any], start_response: Any) -> Any:
        hook = self.on_request
        try:
            if hook is not None:
                hook(environ)
        except ErrorReply as r:
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            body = (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{r.code}</Code>"
                "<Message>injected by the test</Message></Error>"
            ).encode()
            start_response(f"{r.status} Injected", [("Content-Type", "application/xml")])
            return [body]
        except CutReply as c:
            return self._cut(environ, start_response, c.keep)
        except DropReply:
            b"".join(self._app(environ, lambda *_: None))  # done, and its answer dropped
            with contextlib.suppress(OSError):
                environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
            start_response("500 Dropped", [])
            return []
        return self._app(environ, start_response)

    def _cut(self, environ: dict[str, Any], start_response: Any, keep: int) -> Any:
        """moto's reply to the request, cut after ``keep`` bytes of its body."""
        reply: list[Any] = []
        body = b"".join(
            self._app(environ, lambda status, headers, *_: reply.extend([status, headers]))
        )
        start_response(*reply)
        yield body[:keep]
        # The server's end of the connection closes: the client gets the bytes sent so far,
        # then the end of the stream, short of the Content-Length it was told.
        with contextlib.suppress(OSError):
            environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)

    def client(self, endpoint: str | None = None) -> Any:
        """A plain boto3 client of this server, to look behind the storage's back."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        """A new, empty bucket with a unique name."""
        name = f"b-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """storage_options pointing s3fs at this server."""
        return {
            "endpoint_url": endpoint or self.endpoint,
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": "us-east-1"},
            **extra,
        }

    def stop(self) -> None:
        """Shut the server down and wait for its thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def is_complete_upload(environ: dict[str, Any]) -> bool:
    """Whether the request is a CompleteMultipartUpload."""
    query = environ.get("QUERY_STRING", "")
    return environ["REQUEST_METHOD"] == "POST" and "uploadId=" in query


def is_put_object(environ: dict[str, Any]) -> bool:
    """Whether the request is a PutObject (not a part of a multipart upload)."""
    return environ["REQUEST_METHOD"] == "PUT" and "uploadId=" not in environ.get("QUERY_STRING", "")


def is_upload_part(environ: dict[str, Any]) -> bool:
    """Whether the request is an UploadPart of a multipart upload."""
    query = environ.get("QUERY_STRING", "")
    return environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in query and "uploadId=" in query


@contextlib.contextmanager
def running() -> Iterator[S3Server]:
    """A server for the ``with`` block."""
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()
