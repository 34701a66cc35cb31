"""Say so when a client and a server disagree about TLS (gRPC itself only says "Socket closed").

Owns: ``tls_mismatch``: after a call to ``address`` failed UNAVAILABLE, one
probe connection finds out whether the server speaks TLS, whether it wants a
client certificate, and whether the given CA verifies it, and returns a
sentence for the user (None when TLS is not the problem).

Must not know: gRPC, services. The probe sends a TLS ClientHello and reads
at most one record; it never sends a token.
"""

from __future__ import annotations

import socket
import ssl

from core.admin_token import split_address

PROBE_TIMEOUT_S = 3.0
_PLAINTEXT_SIGNS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNEXPECTED_EOF",
                    "EOF occurred", "HTTP_REQUEST", "unknown protocol", "NO_TLS_ANSWER")


def _handshake(host: str, port: int, ctx: ssl.SSLContext, timeout: float) -> str | None:
    """None when the handshake (and one read) succeeds, else the SSL error text; OSError: no TCP."""
    with socket.create_connection((host, port), timeout=timeout) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=host if not host[:1].isdigit() else None) as tls:
                tls.settimeout(min(timeout, 0.5))
                try:
                    # TLS 1.3: a server that wants a client certificate says so (an alert, or it
                    # closes) only after the handshake.
                    if tls.recv(1) == b"":
                        return "CLOSED_AFTER_HANDSHAKE: the server closed the connection after the handshake"
                except (socket.timeout, TimeoutError):
                    pass
                return None
        except ssl.SSLError as exc:
            return f"{exc.reason or ''} {exc}"
        except (ConnectionResetError, BrokenPipeError) as exc:
            return f"UNEXPECTED_EOF {exc}"
        except (socket.timeout, TimeoutError):
            # NOTE: a TLS server answers a ClientHello at once; an HTTP/2 server in plaintext may
            # instead wait for its connection preface, silently.
            return "NO_TLS_ANSWER: the server did not answer the TLS ClientHello"


def _context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols(["h2"])
    if ca:
        ctx.load_verify_locations(ca)
        ctx.check_hostname = False                   # gRPC checks the name; here only the chain matters
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def tls_mismatch(address: str, tls_ca: str | None, tls_cert: str | None = None, tls_key: str | None = None,
                 timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """A sentence naming the TLS disagreement with the server at ``address``, or None."""
    host, port = split_address(address)
    if port is None:
        return None
    host = host.strip("[]") or "127.0.0.1"
    try:
        err = _handshake(host, port, _context(cert=tls_cert, key=tls_key), timeout)
    except (OSError, ValueError):
        return None                                  # not reachable at all: not a TLS question
    plaintext = err is not None and any(s.lower() in err.lower() for s in _PLAINTEXT_SIGNS)
    if not tls_ca:
        if err is None or not plaintext:
            return (f"TLS mismatch: the server at {address} speaks TLS and this client does not: pass --tls-ca CA "
                    f"(and --tls-cert/--tls-key if it requires client certificates)")
        return None
    if plaintext:
        return (f"TLS mismatch: the server at {address} does not speak TLS (plaintext) but this client uses TLS "
                f"(--tls-ca): drop --tls-ca, or enable TLS on the server")
    if err is not None and ("CERTIFICATE_REQUIRED" in err.upper() or not tls_cert):
        return (f"TLS mismatch: the server at {address} requires a client certificate (mutual TLS): "
                f"pass --tls-cert and --tls-key")
    try:
        verify = _handshake(host, port, _context(tls_ca, tls_cert, tls_key), timeout)
    except (OSError, ValueError) as exc:
        return f"TLS: cannot use --tls-ca/--tls-cert/--tls-key: {exc}"
    if verify is not None and "CERTIFICATE_VERIFY_FAILED" in verify.upper():
        return f"TLS mismatch: the certificate of the server at {address} is not signed by --tls-ca {tls_ca}"
    if verify is not None:
        return f"TLS handshake with {address} failed: {verify.strip()}"
    return None
