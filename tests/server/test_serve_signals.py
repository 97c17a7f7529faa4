"""`strata serve` stopped by SIGINT or SIGTERM while requests stream: each client gets a clean
end (an error event and [DONE], or a 503), and the process exits 0 without a hang."""
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import requests

from live_server import metric_value, wait_until_healthy

SERVE = [sys.executable, "-m", "strata", "serve"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_every_running_request_cleanly(model_path, signum):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*SERVE, "-m", str(model_path), "--port", str(port), "-c", "4096",
                               "--parallel", "2", "-t", "2"], stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(server, url)
        body = dict(prompt=[11, 12, 13], max_tokens=4000, temperature=0, ignore_eos=True)
        whole = {}
        thread = threading.Thread(target=lambda: whole.update(r=requests.post(
            url + "/v1/completions", json=body, timeout=60)))
        thread.start()
        stream = requests.post(url + "/v1/completions", json=dict(body, stream=True),
                               stream=True, timeout=60)
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: {"))  # it generates
        while metric_value(SimpleNamespace(url=url), "strata_requests_running") != 2:
            time.sleep(0.01)  # (until the whole-answer request runs too)
        server.send_signal(signum)
        frames = [line for line in lines if line.startswith(b"data: ")]
        assert frames[-1] == b"data: [DONE]"
        assert json.loads(frames[-2][len("data: "):])["error"]["code"] == "shutting_down"
        thread.join(60)
        assert whole["r"].status_code == 503
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
