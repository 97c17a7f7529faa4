"""CORS, so browser UIs served from another origin (a hosted chat UI, a local HTML page, an
editor's webview) can call the server: the policy the --cors-* flags set, the answer to a
browser's preflight (OPTIONS) and the headers every other answer carries, errors included."""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

ANY = "*"
LOCALHOST = "localhost"  # --cors-origins localhost: pages on this machine's loopback names
DEFAULT_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer
# headers a browser sends without asking; a preflight may name them whatever the list says
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_METHOD = re.compile(r"[A-Za-z]+")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class CorsRefusal(Exception):
    """A preflight the policy refuses; the message says what was refused and which flag allows
    it. `code` is the error body's code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser pages may call the server. The default is llama-server's: any origin,
    echoed back with credentials allowed, so a UI on any port or host works as it does with
    llama-server; `origins` (LOCALHOST, or exact origins), `methods` and `headers` narrow it
    (as parse_origins / parse_methods / parse_headers give them: normalized)."""
    origins: tuple[str, ...] = (ANY,)
    methods: tuple[str, ...] = (ANY,)
    headers: tuple[str, ...] = (ANY,)
    allow_credentials: bool = True
    max_age_s: int = DEFAULT_MAX_AGE_S

    @property
    def is_origin_echoed(self) -> bool:
        """Whether an answer names the caller's origin (and so varies with Origin) rather than
        "*": always but for any origin without credentials ("*" does not admit credentials)."""
        return not (self.origins == (ANY,) and not self.allow_credentials)

    def allows_origin(self, origin: str) -> bool:
        if self.origins == (ANY,):
            return True
        if self.origins == (LOCALHOST,):
            return is_local_origin(origin)
        return origin.lower() in self.origins

    def allows_method(self, method: str) -> bool:
        return self.methods == (ANY,) or method.upper() in self.methods

    def response_headers(self, origin: str | None, method: str | None) -> dict[str, str]:
        """The CORS headers of an answer to a request with this Origin (None: none sent) and
        method (None: not known): the origin allowed (so the page may read the answer), or
        no such header (an origin or a method the policy leaves out)."""
        headers = {"Vary": "Origin"} if self.is_origin_echoed else {}
        if origin and self.allows_origin(origin) and (method in (None, "OPTIONS")
                                                      or self.allows_method(method)):
            headers["Access-Control-Allow-Origin"] = origin if self.is_origin_echoed else ANY
            if self.allow_credentials:
                headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def unread_origin_headers(self) -> dict[str, str]:
        """For an answer to a request whose headers could not be read (waitress refused it):
        "*" where every origin may call, so a page still reads the error (not credentialed)."""
        headers = {"Vary": "Origin"} if self.is_origin_echoed else {}
        if self.origins == (ANY,):
            headers["Access-Control-Allow-Origin"] = ANY
        return headers

    def preflight_headers(self, origin: str, method: str, request_headers: str,
                          is_private_network_asked: bool = False) -> dict[str, str]:
        """The answer to a preflight from `origin` for `method` with `request_headers` (the
        Access-Control-Request-Headers value) besides the origin ones; CorsRefusal if refused."""
        if not self.allows_origin(origin):
            allowed = ("pages on this machine (localhost, 127.0.0.1, [::1])"
                       if self.origins == (LOCALHOST,) else ", ".join(self.origins))
            raise CorsRefusal(
                f"The origin {origin!r} may not call this server (--cors-origins allows "
                f"{allowed}); start it with --cors-origins listing {origin!r}.",
                "cors_origin_not_allowed")
        method = method.strip().upper()
        if not self.allows_method(method):
            raise CorsRefusal(
                f"The method {method!r} is not allowed from a browser (--cors-methods allows "
                f"{', '.join(self.methods)}); add it to --cors-methods.",
                "cors_method_not_allowed")
        asked = [h.strip().lower() for h in request_headers.split(",") if h.strip()]
        if self.headers == (ANY,):
            # "*" would not cover Authorization (nor anything under credentials): name them
            allow_headers = ", ".join(asked)
        else:
            refused = [h for h in asked if h not in self.headers and h not in SAFELISTED_HEADERS]
            if refused:
                raise CorsRefusal(
                    f"The header(s) {', '.join(refused)} may not be sent from a browser "
                    f"(--cors-headers allows {', '.join(self.headers)}); add them to "
                    "--cors-headers.", "cors_header_not_allowed")
            allow_headers = ", ".join(self.headers)
        headers = {
            "Access-Control-Allow-Methods": method if self.methods == (ANY,)
            else ", ".join(self.methods),
            "Access-Control-Max-Age": str(self.max_age_s),
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        }
        if allow_headers:
            headers["Access-Control-Allow-Headers"] = allow_headers
        if is_private_network_asked:
            # Chrome asks before a public page may reach a server on this machine or network
            headers["Access-Control-Allow-Private-Network"] = "true"
        return headers


def is_local_origin(origin: str) -> bool:
    """An http(s) page served from this machine: localhost (or a *.localhost name), a loopback
    address such as 127.0.0.1 or [::1], any port."""
    try:
        parts = urlsplit(origin.strip())
        host = parts.hostname or ""
    except ValueError:
        return False
    if parts.scheme not in _DEFAULT_PORTS:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _items(value: str, flag: str, example: str) -> list[str]:
    """A flag's list: comma-separated (llama-server's form) or a JSON list (vLLM's)."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {value!r} is not a JSON list ({e.msg}); give "
                             f"comma-separated values, e.g. {example}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{flag} {value!r} must be a list of strings, e.g. {example}")
    else:
        items = text.split(",")
    items = [i.strip() for i in items if i.strip()]
    if not items:
        raise ValueError(f"{flag}: nothing given; give {ANY!r} or comma-separated values, "
                         f"e.g. {example}")
    if ANY in items and len(items) > 1:
        raise ValueError(f"{flag} {value!r}: {ANY!r} allows everything and must stand alone")
    return items


def normalize_origin(text: str, flag: str = "--cors-origins") -> str:
    """An origin as browsers send it (scheme://host[:port], lower case, no default port), or
    "null" (a file:// page, a sandboxed frame); ValueError naming the mistake otherwise."""
    if text.lower() == "null":
        return "null"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (parts is None or not parts.scheme or not parts.hostname or parts.query
            or parts.fragment or parts.username or parts.password or parts.path):
        hint = (f" (without the path: '{parts.scheme}://{parts.netloc}')"
                if parts is not None and parts.scheme and parts.hostname and parts.path
                else "")
        raise ValueError(f"{flag}: {text!r} is not an origin; give scheme://host[:port] as a "
                         f"browser sends it{hint}, e.g. http://localhost:3000")
    scheme = parts.scheme.lower()
    host = parts.hostname  # lower case, IPv6 without its brackets
    try:
        host = host.encode("idna").decode("ascii")  # browsers send a unicode name in punycode
    except UnicodeError:
        raise ValueError(f"{flag}: {text!r} has a host name that is not valid") from None
    host = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        return f"{scheme}://{host}:{port}"
    return f"{scheme}://{host}"


def parse_origins(value: str, flag: str = "--cors-origins") -> tuple[str, ...]:
    items = _items(value, flag, "http://localhost:3000,https://ui.example.com")
    if items == [ANY]:
        return (ANY,)
    if LOCALHOST in (i.lower() for i in items):
        if len(items) > 1:
            raise ValueError(f"{flag} {value!r}: {LOCALHOST!r} stands alone (it allows every "
                             "page on this machine); list origins such as "
                             "http://localhost:3000 instead to add others")
        return (LOCALHOST,)
    return tuple(dict.fromkeys(normalize_origin(i, flag) for i in items))


def parse_methods(value: str, flag: str = "--cors-methods") -> tuple[str, ...]:
    items = _items(value, flag, "GET,POST")
    if items == [ANY]:
        return (ANY,)
    bad = [i for i in items if not _METHOD.fullmatch(i)]
    if bad:
        raise ValueError(f"{flag}: {bad[0]!r} is not an HTTP method; give methods such as "
                         "GET,POST,DELETE")
    return tuple(dict.fromkeys(i.upper() for i in items))


def parse_headers(value: str, flag: str = "--cors-headers") -> tuple[str, ...]:
    items = _items(value, flag, "Authorization,Content-Type")
    if items == [ANY]:
        return (ANY,)
    bad = [i for i in items if not _HEADER.fullmatch(i)]
    if bad:
        raise ValueError(f"{flag}: {bad[0]!r} is not a header name; give names such as "
                         "Authorization,Content-Type")
    return tuple(dict.fromkeys(i.lower() for i in items))


def install(app, policy: CorsPolicy) -> None:
    """Answer preflights before any other check (a browser sends no API key with one) and put
    the CORS headers on every answer the app gives, errors and streams included. Call it
    before registering the app's own before_request checks."""
    from flask import Response, request

    from strata.server.api_error import ApiError

    @app.before_request
    def answer_preflight():
        if not is_preflight(request.method, request.headers):
            return None
        try:
            headers = policy.preflight_headers(
                request.headers["Origin"], request.headers["Access-Control-Request-Method"],
                request.headers.get("Access-Control-Request-Headers", ""),
                request.headers.get("Access-Control-Request-Private-Network", "").lower()
                == "true")
        except CorsRefusal as refusal:
            raise ApiError(403, str(refusal), code=refusal.code) from None
        response = Response(status=204)
        del response.headers["Content-Type"]  # no content
        for name, value in headers.items():
            _set(response, name, value)
        return response

    @app.after_request
    def add_cors_headers(response):
        for name, value in policy.response_headers(request.headers.get("Origin"),
                                                   request.method).items():
            _set(response, name, value)
        return response


def is_preflight(method: str, headers) -> bool:
    """A browser's preflight: OPTIONS with an Origin and the method it means to send."""
    return (method == "OPTIONS" and "Origin" in headers
            and "Access-Control-Request-Method" in headers)


def _set(response, name: str, value: str) -> None:
    if name == "Vary":
        for field in value.split(","):
            response.vary.add(field.strip())
    else:
        response.headers[name] = value
