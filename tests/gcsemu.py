"""A real GCS-compatible server on 127.0.0.1 (gcp-storage-emulator, in memory) in a child
process: what moto's server mode is for S3. Google's clients reach it through
``STORAGE_EMULATOR_HOST``, and so does raylora (``raylora.storage.GCS_EMULATOR_ENV``).

Run as a script it serves on a free port, prints the port and serves until killed.
"""

from __future__ import annotations

import subprocess
import sys


def start() -> tuple[subprocess.Popen, str]:
    """(the server's process, its endpoint ``http://127.0.0.1:PORT``); stop it with
    ``terminate()``."""
    proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, text=True)
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise RuntimeError(f"the GCS emulator did not start (it printed {port!r})")
    return proc, f"http://127.0.0.1:{port}"


def _serve() -> None:
    """The emulator's server, one thread per connection. Its own HTTPServer serves one at
    a time: a client that stops reading a response (pyarrow's GCS reader holds a download
    open while it asks for another part) then blocks every other process's requests, and
    a run hangs. Changes to its in-memory store stay one at a time (a lock), as they were."""
    import threading
    from http import server as http_server

    from gcp_storage_emulator import server as emulator

    lock = threading.Lock()

    def locked(method):
        def handle(self):
            with lock:
                method(self)
        return handle

    class Handler(emulator.RequestHandler):
        do_POST, do_PUT = locked(emulator.RequestHandler.do_POST), locked(emulator.RequestHandler.do_PUT)
        do_PATCH = locked(emulator.RequestHandler.do_PATCH)
        do_DELETE = locked(emulator.RequestHandler.do_DELETE)

    emulator.RequestHandler = Handler
    emulator.server = type("threaded", (), {"HTTPServer": http_server.ThreadingHTTPServer})
    srv = emulator.create_server("127.0.0.1", 0, in_memory=True)
    srv.start()
    print(srv._api._httpd.server_address[1], flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    _serve()
