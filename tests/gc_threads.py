"""The cyclic GC run in another thread, as it happens in a server: whichever thread allocates
when a collection is due collects (the HTTP server's, the conversation files' I/O threads)."""
import gc
import threading


def collect_in_a_thread(name: str = "no-context") -> None:
    """gc.collect() in a new thread named `name` (no CUDA context is current there)."""
    gc.disable()  # the collection happens there, not on this thread's next allocation
    try:
        worker = threading.Thread(target=gc.collect, name=name)
        worker.start()
        worker.join()
    finally:
        gc.enable()
