"""`strata serve`: the OpenAI-compatible HTTP server on waitress (never Flask's dev server).
The lead registers it with `main.add_command(serve)` in strata/cli.py."""
from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import threading
import time

import click

from strata.cli_options import (ctx_size_option, device_option, draft_options, expert_options,
                                read_chunk_fields, slot_options)
from strata.server.app import ServerConfig, create_app
from strata.server.cors import CorsPolicy, parse_headers, parse_methods, parse_origins

DEFAULT_HTTP_THREADS = 8
DEFAULT_BODY_KIB = 1024
BODY_BYTES_PER_TOKEN = 16  # JSON of a conversation, escapes included, per context token


def body_limit_kib(max_body_kib: int | None, ctx_size: int | None) -> int:
    """--max-body-kib, else 1 MiB or 16 bytes a token of the context, the larger."""
    if max_body_kib is not None:
        return max_body_kib
    return max(DEFAULT_BODY_KIB, (ctx_size or 0) * BODY_BYTES_PER_TOKEN // 1024)


log = logging.getLogger("strata.server")


_OVER_CAP = "strata.body_over_cap"  # environ key: waitress refused this request's body


def _refusing_over_cap(app):
    """The app as waitress calls it: a request whose body waitress refused (`_OVER_CAP`) gets
    the app's own 413 (OpenAI- or Anthropic-style JSON, after the API-key check, counted in
    /metrics) and runs no endpoint; every other request goes to the app as it is."""
    from werkzeug.exceptions import RequestEntityTooLarge

    def application(environ, start_response):
        if not environ.get(_OVER_CAP):
            return app(environ, start_response)
        with app.request_context(environ):
            try:
                answer = app.preprocess_request()  # the API-key check, as for any request
                if answer is None:
                    raise RequestEntityTooLarge()
            except Exception as exc:
                answer = app.handle_user_exception(exc)
            response = app.finalize_request(answer)
        return response(environ, start_response)

    return application


# waitress's own refusals of a request it could not parse, as OpenAI-style error codes
_WAITRESS_ERROR_CODES = {400: "malformed_http_request", 431: "headers_too_large",
                         501: "unsupported_transfer_encoding"}


def _channel_class(cors_policy: CorsPolicy):
    """waitress's connection, but a body over waitress's cap goes to the app (marked
    `_OVER_CAP`, with the body left out) instead of getting waitress's plain-text 413, and
    waitress's other refusals (a malformed request line or header, headers too large, an
    unknown transfer encoding) are JSON in OpenAI's error shape too, with the CORS headers
    the app would give (so a browser page reads the error)."""
    from waitress.channel import HTTPChannel
    from waitress.task import ErrorTask, WSGITask
    from waitress.utilities import RequestEntityTooLarge

    from strata.server.api_error import ApiError

    class JsonErrorTask(ErrorTask):
        def execute(self):
            error = self.request.error  # waitress's Error: code, reason and body
            message = f"{error.reason}: {error.body}".rstrip(". ") + "."
            answer = ApiError(error.code, message,
                              code=_WAITRESS_ERROR_CODES.get(error.code, "malformed_http_request"))
            body = json.dumps(answer.body()).encode()
            self.status = f"{error.code} {error.reason}"
            self.response_headers.append(("Content-Type", "application/json"))
            # waitress's header names; none read where the headers were too large to parse
            origin = self.request.headers.get("ORIGIN")
            cors_headers = (cors_policy.response_headers(origin, None) if origin
                            else cors_policy.unread_origin_headers())
            self.response_headers.extend(cors_headers.items())
            self.set_close_on_finish()  # waitress could not frame the request: no more on it
            self.content_length = len(body)
            self.write(body)

    class OverCapTask(WSGITask):
        def get_environment(self):
            environ = super().get_environment()
            request = self.request
            environ[_OVER_CAP] = True
            environ["wsgi.input"] = io.BytesIO()
            # what the client declared or already sent, over the app's limit
            environ["CONTENT_LENGTH"] = str(max(request.content_length,
                                                request.body_bytes_received))
            environ.pop("HTTP_TRANSFER_ENCODING", None)
            return environ

        def execute(self):
            # The rest of the body is still on its way: this connection carries no more.
            self.set_close_on_finish()
            super().execute()

    def error_task(channel, request):
        if isinstance(request.error, RequestEntityTooLarge):
            return OverCapTask(channel, request)
        return JsonErrorTask(channel, request)

    class Channel(HTTPChannel):
        error_task_class = staticmethod(error_task)

    return Channel


def connection_limit() -> int:
    """How many connections waitress keeps open at once: half the process's file descriptors,
    at most 1000. waitress's default, 100, counts idle keep-alive connections (dropped only
    after 120 s), so agents' connection pools holding ~100 of them locked every new client out
    for up to two minutes."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 100
    if soft == resource.RLIM_INFINITY:
        return 1000
    return max(100, min(1000, soft // 2))


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), for `create_wsgi_server`; a busy
    port or an unknown host fails here (OSError), leaking nothing."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def create_wsgi_server(app, host: str, port: int, threads: int = DEFAULT_HTTP_THREADS,
                       sock: socket.socket | None = None):
    """A waitress server for the app on `sock`, else on a socket bound here to host:port (port
    0: a free one; see `.effective_port`). Lookahead lets waitress notice a client that went
    away while its request is still running."""
    import waitress

    sock = sock if sock is not None else bind_socket(host, port)
    try:
        # waitress buffers a body whole before the app sees it, and refuses one past this cap
        # as it arrives: by its Content-Length before reading it, a chunked one once this much
        # has come. The slack over the app's limit is for chunked framing; whichever refuses
        # it, the client gets the app's JSON 413.
        body_limit_bytes = 2 * (app.config.get("MAX_CONTENT_LENGTH") or 2**20) + 2**16
        server = waitress.create_server(_refusing_over_cap(app), sockets=[sock],
                                        threads=threads,
                                        channel_request_lookahead=1, ident="strata",
                                        max_request_body_size=body_limit_bytes,
                                        connection_limit=connection_limit())
    except BaseException:
        sock.close()
        raise
    state = app.extensions.get("strata")
    server.channel_class = _channel_class(state.config.cors if state else CorsPolicy())
    return server


def _stop_if_the_load_fails(worker) -> None:
    """A model that cannot load stops the server, as llama-server does: the engine thread
    loads it while the server already listens (/health says "loading"), and when the load
    fails this signals the main thread, which closes the server and exits with the error."""
    def watch():
        worker.wait_loaded()
        if worker.state == "error":
            os.kill(os.getpid(), signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        threading.Thread(target=watch, name="strata-load-watch", daemon=True).start()


def _stop_gracefully(server, state, timeout_s: float = 5.0) -> None:
    """The engine stops first, while the server's loop still sends: every running request
    ends with its answer (a stream's error event and [DONE], a 503), whoever asks next gets a
    503; then, once the request threads are done and their bytes went out (at most about
    `timeout_s`), the loop ends and `server.run()` returns."""
    from waitress import wasyncore

    # no new connections (on the loop's thread; the trigger stays open)
    server.trigger.pull_trigger(lambda: wasyncore.dispatcher.close(server))
    state.close()
    server.task_dispatcher.shutdown(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            getattr(channel, "total_outbufs_len", 0) for channel in list(server._map.values())):
        time.sleep(0.02)
    # The last thunk closes every channel, the trigger's pipe too. pull_trigger queues it and
    # then writes the wake-up byte, and the loop, awake for the first thunk's byte, may run it
    # between the two: the write then went to a closed (or reused) descriptor, and its
    # traceback came out after the server's last line. Queued and written under the lock the
    # loop runs thunks under, the byte is in before the pipe can close.
    trigger = server.trigger
    with trigger.lock:
        trigger.thunks.append(lambda: wasyncore.close_all(server._map))
        trigger._physical_pull()


def _stop_on_signals(server, state) -> threading.Thread:
    """SIGINT (Ctrl-C) and SIGTERM (service managers, `kill`) stop the server gracefully (the
    returned thread runs `_stop_gracefully`); a second signal ends the loop at once (waitress
    still gives its threads about 5 s)."""
    stopper = threading.Thread(target=_stop_gracefully, args=(server, state),
                               name="strata-stop", daemon=True)

    def handler(signum, frame):
        if stopper.ident is not None:
            raise SystemExit(0)  # the second signal: no more waiting
        log.info("stopping: the running requests end with 503 shutting_down (again to stop "
                 "sooner)")
        stopper.start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
    return stopper


def _cors_list(parse):
    """A click callback: the flag's value parsed (a clear usage error if it is wrong)."""
    def callback(ctx, param, value):
        flag = param.opts[0]
        try:
            return parse(value, flag)
        except ValueError as e:  # click names the flag already
            raise click.BadParameter(str(e).removeprefix(flag).lstrip(": ")) from None
    return callback


@click.command()
@click.option("--model", "-m", "model", default=None,
              help="GGUF model (default: $STRATA_MODEL, else the packaged default model).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 exposes the server to the network).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="STRATA_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every "
                   "endpoint but /health (default: $STRATA_API_KEY; none: open).")
@click.option("--alias", "-a", default=None,
              help="The model name(s) requests give, comma-separated (default: the file "
                   "name without .gguf); the first is the id in /v1/models. E.g. the names "
                   "an agent sends for its main and its small model.")
@ctx_size_option
@click.option("--threads", "-t", default=None, type=int, help="CPU threads (default: all).")
@click.option("--max-body-kib", default=None, type=click.IntRange(1),
              help="Largest request body accepted (KiB); larger ones get 413 (default: "
                   "1024, or 16 bytes a token of a larger --ctx-size: an agent resends its "
                   "whole conversation each turn).")
@click.option("--reasoning-budget", default=-1, show_default=True, type=click.IntRange(-1),
              help="Tokens a reasoning model's <think> block may take before it is closed "
                   "(-1: no limit; 0: closed at once). A request's own budget (Anthropic's "
                   "thinking.budget_tokens) wins.")
@click.option("--http-threads", default=DEFAULT_HTTP_THREADS, show_default=True,
              type=click.IntRange(1), help="Request threads (each open stream holds one).")
@click.option("--slots/--no-slots", "is_slots_endpoint_on", default=True, show_default=True,
              help="Answer GET /slots (each slot's state, as llama.cpp's); --no-slots: 501.")
@click.option("--slot-save-path", default=None, metavar="DIR",
              type=click.Path(file_okay=False, dir_okay=True, exists=True),
              help="Folder for POST /slots/ID?action=save|restore (an idle slot's KV as a file "
                   "the request names; off without it).")
@click.option("--cors-origins", "--allowed-origins", "cors_origins", default="*",
              show_default=True, envvar="STRATA_CORS_ORIGINS", metavar="ORIGINS",
              callback=_cors_list(parse_origins),
              help="Browser pages (origins) that may call the server, for web UIs served "
                   "elsewhere: '*' (any, as llama-server and vLLM), 'localhost' (pages on "
                   "this machine), or origins such as http://localhost:3000, comma-separated "
                   "or a JSON list (default: $STRATA_CORS_ORIGINS, else '*').")
@click.option("--cors-methods", "--allowed-methods", "cors_methods", default="*",
              show_default=True, metavar="METHODS", callback=_cors_list(parse_methods),
              help="HTTP methods a browser page may use, e.g. GET,POST ('*': any).")
@click.option("--cors-headers", "--allowed-headers", "cors_headers", default="*",
              show_default=True, metavar="HEADERS", callback=_cors_list(parse_headers),
              help="Request headers a browser page may send besides the always-allowed ones "
                   "(Content-Type, Accept...), e.g. Authorization,X-Api-Key ('*': any).")
@click.option("--cors-credentials/--no-cors-credentials", "--allow-credentials",
              "is_cors_credentials_on", default=True, show_default=True,
              help="Let browser pages send credentials (cookies, an auth proxy's login): the "
                   "page's origin is named in each answer instead of '*'.")
@click.option("--verbose", "-v", "is_verbose", is_flag=True,
              help="Log the engine's every step too (DEBUG): each prompt chunk, each window's "
                   "expert cache use, the tier's rounds.")
@device_option
@slot_options
@expert_options
@draft_options
def serve(model, host, port, api_key, alias, ctx_size, threads, max_body_kib, reasoning_budget,
          http_threads, is_slots_endpoint_on, slot_save_path, cors_origins, cors_methods,
          cors_headers, is_cors_credentials_on, is_verbose, device, parallel, read_chunk,
          conversation_cache_mib, ctx_checkpoints, conversation_files, expert_config,
          draft_config):
    """Serve the model with OpenAI's API (/v1/chat/completions, /v1/completions,
    /v1/responses), Anthropic's (/v1/messages) and llama.cpp's code completion (/infill)."""
    from strata.cli import fail, resolve_model
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.errors import StrataError

    path = resolve_model(model)
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty; give a key or leave the option out")
    if api_key is not None:  # a key read from an env file may end in '\r': clients strip it
        api_key = api_key.strip()
    names = [n.strip() for n in (alias or "").split(",") if n.strip()]
    if alias is not None and not names:
        fail("--alias is empty; give one or more model names, comma-separated")
    try:
        engine_config = EngineConfig(path, n_ctx=ctx_size, threads=threads, device=device,
                                     parallel=parallel,
                                     **read_chunk_fields(read_chunk),
                                     conversation_cache_mib=conversation_cache_mib,
                                     ctx_checkpoints=ctx_checkpoints,
                                     **conversation_files,
                                     **expert_config, **draft_config)
    except StrataError as e:
        fail(str(e))
    if slot_save_path is not None and engine_config.conversation_cache_dir is not None:
        conversations = engine_config.resolve_conversation_dir()
        if conversations.exists() and os.path.samefile(slot_save_path, conversations):
            fail(f"--slot-save-path {slot_save_path} is the conversation cache's folder "
                 "(--conversation-cache-dir): the cache would take its slot files for "
                 "conversations and delete them as it evicts; give each a folder of its own")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    if is_verbose:  # Strata's own loggers only: waitress's and the libraries' stay at INFO
        logging.getLogger("strata").setLevel(logging.DEBUG)
    config = ServerConfig(model_id=names[0] if names else path.stem, aliases=tuple(names[1:]),
                          api_key=api_key, max_body_kib=body_limit_kib(max_body_kib, ctx_size),
                          reasoning_budget=None if reasoning_budget < 0 else reasoning_budget,
                          is_slots_endpoint_on=is_slots_endpoint_on,
                          slot_save_path=slot_save_path,
                          cors=CorsPolicy(origins=cors_origins, methods=cors_methods,
                                          headers=cors_headers,
                                          allow_credentials=is_cors_credentials_on))
    # Bound before the model loads: a busy port fails at once, not after a load, and the
    # address is printed before a load error can be.
    try:
        sock = bind_socket(host, port)
    except OSError as e:
        fail(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or "
             "--host")
    served = ", ".join((config.model_id,) + config.aliases)
    click.echo(f"strata: serving {path.name} as {served} on "
               f"http://{host}:{sock.getsockname()[1]} (OpenAI and Anthropic APIs under /v1)",
               err=True)
    # The model loads on the engine thread; /health says "loading" until it is ready.
    app = create_app(lambda: Engine(engine_config), config)
    try:
        server = create_wsgi_server(app, host, port, threads=http_threads, sock=sock)
    except BaseException:  # (the socket is closed by now)
        app.extensions["strata"].close()
        raise
    stopper = _stop_on_signals(server, app.extensions["strata"])
    worker = app.extensions["strata"].worker
    try:
        _stop_if_the_load_fails(worker)
        server.run()  # returns when _stop_gracefully ends the loop, or on a second signal
        if stopper.ident is not None:  # it ended the loop: let it return before the exit
            stopper.join(timeout=5.0)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.close()
        app.extensions["strata"].close()
    if worker.state == "error":
        fail(f"the model failed to load, so the server stopped: {worker.error_message}")
