"""The Flask app factory: routes, API-key check, errors for every failure (OpenAI's shape, or
Anthropic's under /v1/messages), metrics. One engine thread (the worker) runs the model; request
threads queue jobs and stream events."""
from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from strata.server.anthropic_format import error_body as anthropic_error_body
from strata.server import cors
from strata.server.api_error import ApiError
from strata.server.generation import GenerationRoutes
from strata.server.completion_api import CompletionRoutes
from strata.server.infill_api import InfillRoutes
from strata.server.messages import MessagesRoutes, is_messages_path
from strata.server.metrics import ServerMetrics
from strata.server.responses_api import ResponsesRoutes
from strata.server.slots_api import SlotsRoutes
from strata.server.tokens_api import TokenRoutes
from strata.server.worker import EngineWorker

log = logging.getLogger("strata.server")


@dataclass
class ServerConfig:
    """Options of the HTTP layer. `model_id` None: the GGUF file name stem. `aliases`: other
    model names the API answers to (listed after it in /v1/models)."""
    model_id: str | None = None
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_kib: int = 1024
    keepalive_s: float = 5.0
    reasoning_budget: int | None = None  # a request's <think> budget unless it sets one
    is_slots_endpoint_on: bool = True  # GET /slots answers (--no-slots: 501)
    slot_save_path: str | None = None  # POST /slots/ID?action=... files here (None: 501)
    cors: cors.CorsPolicy = field(default_factory=cors.CorsPolicy)  # the --cors-* flags


class ServerState:
    """What the routes share; kept in `app.extensions["strata"]`."""

    def __init__(self, worker: EngineWorker, config: ServerConfig, metrics: ServerMetrics):
        self.worker = worker
        self.config = config
        self.metrics = metrics
        self.created = int(time.time())

    @property
    def model_id(self) -> str:
        if self.config.model_id:
            return self.config.model_id
        engine = self.worker.engine
        if engine is not None:
            return Path(engine.config.model_path).stem
        return "model"

    @property
    def model_names(self) -> list[str]:
        """Every name a request's `model` may give: the id first, then the aliases."""
        return [self.model_id] + [a for a in self.config.aliases if a != self.model_id]

    def close(self) -> None:
        self.worker.stop()


_STATUS_TEXT = {
    404: ("not_found", "Unknown endpoint {method} {path}; this server serves "
          "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, "
          "/v1/messages/count_tokens, /completion, /infill, /tokenize, /detokenize, "
          "/apply-template, "
          "/v1/models, /props, /slots, /health and /metrics."),
    405: ("method_not_allowed", "{method} is not allowed on {path}; see the OpenAI API for the "
          "method this endpoint takes."),
    413: ("request_too_large", "The request body is larger than {limit} KiB; send a smaller "
          "request or start the server with a larger --max-body-kib."),
}


def create_app(engine, config: ServerConfig | None = None) -> Flask:
    """The app. `engine` is an Engine, or a callable that builds one on the engine thread (so
    /health answers "loading" meanwhile). Call `app.extensions["strata"].close()` to stop."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    worker = EngineWorker(engine, metrics)
    metrics.watch_expert_tier(
        lambda: getattr(worker.engine, "expert_tier", None) if worker.state == "ok" else None)
    metrics.watch_conversations(
        lambda: worker.engine.scheduler.conversations if worker.state == "ok" else None)
    state = ServerState(worker, config, metrics)
    app = Flask("strata.server")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_kib * 1024
    app.json.sort_keys = False
    app.extensions["strata"] = state
    routes = GenerationRoutes(state)
    messages = MessagesRoutes(state)
    responses = ResponsesRoutes(state)
    infill = InfillRoutes(state)
    tokens = TokenRoutes(state)
    slots = SlotsRoutes(state)
    cors.install(app, config.cors)  # first: a browser's preflight carries no API key

    @app.before_request
    def check_api_key():
        if config.api_key is None or request.path == "/health":
            return None
        # OpenAI's clients send a bearer token, Anthropic's an x-api-key header
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                                   config.api_key.encode("utf-8")):
            raise ApiError(401, "Missing or wrong API key: send the header "
                           "'Authorization: Bearer KEY' (or 'x-api-key: KEY') with the key the "
                           "server was started with.", code="invalid_api_key")
        return None

    def error_response(err: ApiError) -> Response:
        # the client is told; the operator sees what was refused, and why, here
        log.info("%s %s refused: %d %s: %s", request.method, request.path, err.status,
                 err.code, err.message)
        body = anthropic_error_body(err) if is_messages_path(request.path) else err.body()
        response = jsonify(body)
        response.status_code = err.status
        return response

    @app.after_request
    def count(response: Response) -> Response:
        rule = request.url_rule
        metrics.count_response(response, request.path, rule.rule if rule is not None else None,
                               request.environ.get("waitress.client_disconnected"))
        return response

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError):
        return error_response(exc)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code, text = _STATUS_TEXT.get(exc.code, ("invalid_request", "{description}"))
        message = text.format(method=request.method, path=request.path,
                              limit=config.max_body_kib, description=exc.description)
        response = error_response(ApiError(exc.code or 400, message, code=code))
        if exc.code == 405:
            response.headers["Allow"] = ", ".join(getattr(exc, "valid_methods", None) or [])
        return response

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "The server failed on this request; its log has "
                                       "the details.", code="internal_error"))

    @app.get("/health")
    def health():
        # a stopping server says so (503), so a load balancer sends no more work its way
        status = "shutting_down" if worker.is_stopping else worker.state
        body = {"status": status}
        if status == "error":
            body["message"] = worker.error_message
        return jsonify(body), 200 if status == "ok" else 503

    @app.get("/metrics")
    def prometheus():
        return Response(metrics.render(), mimetype=None, content_type=metrics.content_type)

    @app.get("/v1/models")
    def list_models():
        cards = [_model_card(state, name) for name in state.model_names]
        # OpenAI's list, with the fields Anthropic's clients read beside it
        return jsonify({"object": "list", "data": cards, "has_more": False,
                        "first_id": cards[0]["id"], "last_id": cards[-1]["id"]})

    @app.get("/v1/models/<path:model>")
    def get_model(model: str):
        routes.check_model(model)
        return jsonify(_model_card(state, model))

    app.add_url_rule("/v1/chat/completions", "chat", routes.chat, methods=["POST"])
    app.add_url_rule("/v1/completions", "completions", routes.completions, methods=["POST"])
    app.add_url_rule("/v1/responses", "responses", responses.responses, methods=["POST"])
    app.add_url_rule("/infill", "infill", infill.infill, methods=["POST"])
    completion = CompletionRoutes(state)
    for path in ("/completion", "/completions"):  # llama-server takes both
        app.add_url_rule(path, "llama" + path.replace("/", "_"), completion.completion,
                         methods=["POST"])
    app.add_url_rule("/tokenize", "tokenize", tokens.tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", "detokenize", tokens.detokenize, methods=["POST"])
    app.add_url_rule("/apply-template", "apply_template", tokens.apply_template,
                     methods=["POST"])
    app.add_url_rule("/props", "props", slots.props, methods=["GET"])
    app.add_url_rule("/slots", "slots", slots.slots, methods=["GET"])
    app.add_url_rule("/slots/<int:id_slot>", "slot_action", slots.slot_action,
                     methods=["POST"])

    @app.route("/v1/responses/<path:response_id>", methods=["GET", "DELETE", "POST"])
    def stored_response(response_id: str):
        raise ApiError(404, f"No response {response_id!r} is kept: this server stores no "
                       "responses (every request is answered as with store: false); send the "
                       "whole conversation in 'input'.", code="response_not_found")
    app.add_url_rule("/v1/messages", "messages", messages.messages, methods=["POST"])
    app.add_url_rule("/v1/messages/count_tokens", "count_tokens", messages.count_tokens,
                     methods=["POST"])
    worker.start()
    return app


def _model_card(state: ServerState, name: str) -> dict:
    """OpenAI's model object, with Anthropic's fields (type, display_name, created_at and, once
    the model is loaded, the context as max_input_tokens / max_tokens)."""
    created_at = datetime.fromtimestamp(state.created, timezone.utc)
    card = {"id": name, "object": "model", "created": state.created,
            "owned_by": "strata", "type": "model", "display_name": name,
            "created_at": created_at.isoformat().replace("+00:00", "Z")}
    if state.worker.state == "ok":
        card["max_input_tokens"] = card["max_tokens"] = state.worker.engine.n_ctx
    return card
