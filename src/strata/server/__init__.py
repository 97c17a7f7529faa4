"""The OpenAI-compatible HTTP server: app factory, request schema, output parsing, metrics."""
from strata.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
