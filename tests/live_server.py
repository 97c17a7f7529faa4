"""A live server for tests: an app behind waitress on a free port, in a thread."""
import threading
from dataclasses import dataclass

from strata.server.app import ServerConfig, create_app
from strata.server.command import create_wsgi_server


@dataclass
class LiveServer:
    url: str
    app: object
    server: object
    thread: threading.Thread

    @property
    def state(self):
        return self.app.extensions["strata"]

    def stop(self):
        from waitress import wasyncore

        self.server.task_dispatcher.shutdown(timeout=5)
        # Close every channel from inside the server's own loop, which then ends. (Seen once
        # in session 48: the trigger's descriptor already closed, EBADF; the loop was ending.)
        try:
            self.server.trigger.pull_trigger(lambda: wasyncore.close_all(self.server._map))
        except OSError:
            pass
        self.thread.join(10)
        self.state.close()
        assert not self.thread.is_alive(), "the waitress loop did not stop"


def start_live_server(engine_source, config: ServerConfig) -> LiveServer:
    app = create_app(engine_source, config)
    server = create_wsgi_server(app, "127.0.0.1", 0, threads=6)
    thread = threading.Thread(target=server.run, name="waitress-test", daemon=True)
    thread.start()
    assert app.extensions["strata"].worker.wait_loaded(30)
    return LiveServer(f"http://127.0.0.1:{server.effective_port}", app, server, thread)


def metric_value(live, name: str, **labels: str) -> float:
    """One sample of a live server's /metrics, by its name (and labels, those given)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(live.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


def wait_until_healthy(server, url: str, tries: int = 600) -> None:
    """Wait for a `strata serve` subprocess (`server`, a Popen) to answer /health with 200."""
    import time

    import requests

    for _ in range(tries):
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        assert server.poll() is None, "the server exited while starting"
        time.sleep(0.1)
