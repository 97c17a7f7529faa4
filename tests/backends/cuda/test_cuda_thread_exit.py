"""A thread that built a CUDA model ends without taking the process down: PyCUDA aborts
(SIGABRT, "the context stack was not empty") when a thread ends with a context on its stack,
and `strata serve` builds its engine on the engine thread, so every stop of a GPU server
ended in that abort (rc 134) until the engine thread released its contexts as it ended."""
import re
import signal
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from live_server import wait_until_healthy

pytestmark = pytest.mark.cuda


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_a_thread_that_built_a_runtime_and_failed_ends_cleanly():
    done = _run("""
        import threading
        from strata.backends.select import release_thread_gpu

        def body():
            try:
                from strata.backends.cuda.runtime import Runtime
                Runtime()
                raise ValueError("the model did not fit")
            except ValueError:
                pass
            finally:
                release_thread_gpu()

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        print("joined")
        """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "joined" in done.stdout and "PyCUDA ERROR" not in done.stderr


def test_a_served_gpu_engine_stops_with_exit_code_0(synth_path):
    path = synth_path("tiny", "q4_0")
    server = subprocess.Popen([sys.executable, "-m", "strata", "serve", "-m", str(path),
                               "--device", "cuda", "--expert-cache", "0", "-t", "2",
                               "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in server.stderr:  # "strata: serving ... on http://127.0.0.1:PORT ..."
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "the server never said where it serves"
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(server, url)  # the model loads on the engine thread
        body = b'{"prompt": "hello there", "max_tokens": 4}'
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200
        server.send_signal(signal.SIGTERM)
        rest = server.stderr.read()
        assert server.wait(timeout=60) == 0, rest[-3000:]
        assert "PyCUDA ERROR" not in rest
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stderr.close()  # (left open, its pipe is a ResourceWarning, an error here)
