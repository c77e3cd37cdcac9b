"""A local S3-compatible server for tests: moto in server mode on
127.0.0.1 at a free port, stopped when the module's tests are done.

:func:`serve` is a context manager (benchmarks use it too); test modules
wrap it in a module-scoped fixture. Tests skip only where moto (with its
server extra) or s3fs is not installed: :func:`require` skips them.

moto checks ``If-None-Match: *`` and then stores the object in two Python
steps, so two conditional PUTs handled by two server threads at once can
both succeed -- S3 itself arbitrates them atomically. The server here runs
writes (PUT/POST/DELETE) one at a time, which is what S3 guarantees; reads
stay concurrent. dstt's own code gets no help from this: a "check, then put"
client can still lose the race against it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]
    storage_options: dict[str, Any] = field(default_factory=dict)

    def new_bucket(self) -> str:
        """A fresh bucket's name."""
        import boto3

        name = f"dstt-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=name)
        return name

    def url(self, path: str = "run") -> str:
        """``s3://<fresh bucket>/<path>``."""
        return f"s3://{self.new_bucket()}/{path}"

    def subprocess_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def _serialized_writes(app: Any, latency_s: float = 0.0) -> Any:
    lock = threading.Lock()

    def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
        if latency_s:
            time.sleep(latency_s)  # a network round trip (benchmarks): waits, uses no CPU
        if environ.get("REQUEST_METHOD") in ("PUT", "POST", "DELETE"):
            with lock:
                return list(app(environ, start_response))
        return app(environ, start_response)

    return wsgi


def require() -> None:
    """Skip the calling test unless moto's server, boto3 and s3fs import."""
    import pytest

    for mod in ("s3fs", "boto3", "werkzeug", "moto.moto_server.werkzeug_app"):
        pytest.importorskip(mod)


@contextlib.contextmanager
def serve(quiet: bool = True, latency_s: float = 0.0) -> Iterator[S3Server]:
    """Run the server (AWS_* variables set for this process) until the block
    ends; ``latency_s`` delays every request (an emulated network round trip)."""
    import logging

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from s3fs import S3FileSystem
    from werkzeug.serving import make_server

    if quiet:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = DomainDispatcherApplication(create_backend_app)
    server = make_server("127.0.0.1", 0, _serialized_writes(app, latency_s), threaded=True)  # port 0: a free one
    thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    S3FileSystem.clear_instance_cache()  # no instance pointing at an earlier server
    try:
        yield S3Server(endpoint, env, {"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
    finally:
        S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.shutdown()
        thread.join(timeout=10)
