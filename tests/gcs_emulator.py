"""``python tests/gcs_emulator.py --port P``: gcp-storage-emulator on 127.0.0.1, in memory,
with bucket ``bkt``, made to answer object reads and writes as GCS does where tensorstore
(orbax's array writer) depends on it.

The emulator (2026.7.19) leaves out two things of the GCS JSON API:

* a media download carries no ``x-goog-generation`` header, which tensorstore reads as the
  object's version ("Malformed StorageGeneration" otherwise);
* the ``ifGenerationMatch`` / ``ifGenerationNotMatch`` preconditions of uploads and
  downloads are ignored. OCDBT (orbax's default array format) swaps its manifest with a
  conditional write and re-reads it with ``ifGenerationNotMatch``; without them two writers
  (or a writer and its own cache) disagree and saves fail or hang.

Both are added here around the emulator's own handlers. Its HTTP server also answers one
connection at a time, so a client that holds a connection open (several processes' writers at
once) stalls every other: here connections are taken in threads and their requests handled
one at a time under a lock.
"""

from __future__ import annotations

import argparse
import threading
import types
from http import HTTPStatus
from http.server import ThreadingHTTPServer

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_LOCK = threading.RLock()


def _current_generation(storage, bucket: str, name: str) -> str | None:
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return None


def _precondition_fails(request, current: str | None) -> HTTPStatus | None:
    """The status a GCS precondition gives (412, or 304 for a read), or None if it holds."""
    match = request.query.get("ifGenerationMatch")
    if match is not None:
        want = match[0]
        if (want == "0" and current is not None) or (want != "0" and want != current):
            return HTTPStatus.PRECONDITION_FAILED
    not_match = request.query.get("ifGenerationNotMatch")
    if not_match is not None and current is not None and not_match[0] == current:
        return HTTPStatus.NOT_MODIFIED
    return None


_download, _insert = objects.download, objects.insert


def download(request, response, storage, *args, **kwargs):
    with _LOCK:
        current = _current_generation(storage, request.params["bucket_name"],
                                      request.params["object_id"])
        failed = _precondition_fails(request, current)
        if failed is not None and current is not None:
            response.status = failed
            response["x-goog-generation"] = current
            return
        _download(request, response, storage, *args, **kwargs)
        if current is not None and response.status in (HTTPStatus.OK,
                                                        HTTPStatus.PARTIAL_CONTENT):
            response["x-goog-generation"] = current
            response["x-goog-metageneration"] = "1"


def insert(request, response, storage, *args, **kwargs):
    with _LOCK:
        name = (request.query.get("name") or [None])[0]
        if name is not None:
            current = _current_generation(storage, request.params["bucket_name"], name)
            failed = _precondition_fails(request, current)
            if failed is HTTPStatus.PRECONDITION_FAILED:
                response.status = failed
                return
        _insert(request, response, storage, *args, **kwargs)


objects.download, objects.insert = download, insert


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # Imported after the patch: the server's route table holds the handler functions.
    from gcp_storage_emulator import server as emulator

    handle = emulator.Router.handle

    def handle_one(self, method):
        with _LOCK:
            return handle(self, method)

    emulator.Router.handle = handle_one
    emulator.server = types.SimpleNamespace(HTTPServer=ThreadingHTTPServer)
    server = emulator.create_server("127.0.0.1", args.port, in_memory=True,
                                    default_bucket="bkt")
    server.run()


if __name__ == "__main__":
    main()
