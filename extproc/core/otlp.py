"""Where spans go, over what, and which are kept: one decision for Envoy and the processor.

Envoy's tracer (rendered by `extproc render-envoy`) and the processor's SDK must export to
the same collector, the same way, and sample alike, or the processor's spans lose their
parent (decision 0036). Both read their settings through `trace_export()`: the config file
first (`telemetry.*`), then the standard `OTEL_*` variables, as docs/telemetry.md lists.
Pure: the environment is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from .config import ConfigError, TelemetryConfig

# Envoy has no "system roots" switch of its own: Debian's and Ubuntu's bundle, which the
# Envoy images (and Debian's ca-certificates package) carry.
SYSTEM_CA_FILE = "/etc/ssl/certs/ca-certificates.crt"
_PRE = "OTEL_EXPORTER_OTLP_"
# OTEL_TRACES_SAMPLER values we can honour on both sides: (fixed ratio or None: the _ARG).
_SAMPLERS: dict[str, float | None] = {
    "always_on": 1.0, "always_off": 0.0, "traceidratio": None,
    "parentbased_always_on": 1.0, "parentbased_always_off": 0.0,
    "parentbased_traceidratio": None,
}


@dataclass(frozen=True)
class Endpoint:
    scheme: str | None  # "http", "https", or None for a bare host:port
    host: str
    port: int


def split_endpoint(s: str) -> Endpoint:
    """`http://h:p`, `https://h:p` or a bare `h:p` (an IPv6 host in brackets); a path is
    ignored, as the OTLP/gRPC exporters ignore it. ValueError says what is wrong."""
    s = s.strip()
    scheme: str | None = None
    if "://" in s:
        u = urlsplit(s)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http:// or https://, got {s!r}")
        scheme, hostport = u.scheme, u.netloc
    else:
        hostport = s
    host, sep, port = hostport.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port, http://host:port or https://host:port, got {s!r}")
    return Endpoint(scheme, host, int(port))


@dataclass(frozen=True)
class TraceExport:
    """Envoy's tracer and the processor's span exporter, as one decision."""

    endpoint: Endpoint
    tls: bool
    # With tls: the CA bundle to verify the collector by; None: the platform's roots
    # (SYSTEM_CA_FILE for Envoy, gRPC's default roots for the processor).
    ca_file: str | None
    # Head sampling for a trace that starts here; a parent's decision is always followed.
    ratio: float
    source: str  # the setting the endpoint came from, for messages
    # gRPC metadata on every export call (OTEL_EXPORTER_OTLP_(TRACES_)HEADERS), e.g. a
    # collector's token.
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def target(self) -> str:
        """host:port as a gRPC channel dials it."""
        h = self.endpoint.host
        return f"[{h}]:{self.endpoint.port}" if ":" in h else f"{h}:{self.endpoint.port}"


def _get(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` set (non-blank) in env: (name, value)."""
    for n in names:
        v = env.get(n, "").strip()
        if v:
            return n, v
    return None


def export_headers(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` (values may be %-encoded), as the SDK reads it; names lowercased.
    An entry that is not `name=value` is a config error naming the variable."""
    got = _get(env, _PRE + "TRACES_HEADERS", _PRE + "HEADERS")
    if got is None:
        return ()
    out: dict[str, str] = {}
    for item in got[1].split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = unquote(name).strip().lower()
        if not sep or not name or any(c.isspace() or c in ':"(),/;<=>?@[]{}' for c in name):
            raise ConfigError(got[0], f"each entry must be name=value, got {item.strip()!r}")
        out[name] = unquote(value).strip()
    return tuple(out.items())


def sampling_ratio(cfg: TelemetryConfig, env: Mapping[str, str]) -> float:
    """telemetry.sampling_ratio if set off its default, else OTEL_TRACES_SAMPLER(_ARG).

    Both sides are always parent-based: Envoy's tracer follows a traceparent's flag, and a
    processor sampling on its own would cut the trace Envoy started. A non-parent-based
    name (traceidratio, always_on, always_off) gives its ratio to roots only.
    """
    if cfg.sampling_ratio != TelemetryConfig.sampling_ratio:
        return cfg.sampling_ratio
    got = _get(env, "OTEL_TRACES_SAMPLER")
    if got is None:
        return cfg.sampling_ratio
    name = got[1].lower()
    if name not in _SAMPLERS:
        raise ConfigError("OTEL_TRACES_SAMPLER",
                          f"must be one of {sorted(_SAMPLERS)}, got {got[1]!r}")
    fixed = _SAMPLERS[name]
    if fixed is not None:
        return fixed
    arg = _get(env, "OTEL_TRACES_SAMPLER_ARG")
    if arg is None:
        return 1.0  # the SDK's default ratio
    try:
        r = float(arg[1])
    except ValueError:
        r = -1.0
    if not 0.0 <= r <= 1.0:
        raise ConfigError("OTEL_TRACES_SAMPLER_ARG", f"must be a ratio in [0, 1], got {arg[1]!r}")
    return r


def trace_export(cfg: TelemetryConfig, env: Mapping[str, str]) -> TraceExport | None:
    """None: no spans (no endpoint, OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none).

    A scheme decides TLS (https) or plaintext (http). Without one, the file's
    `otlp_endpoint` means plaintext, as it always has, and a variable's means TLS, as the
    OpenTelemetry specification has it; either way an OTEL_EXPORTER_OTLP_(TRACES_)INSECURE
    set to true or false decides instead.
    """
    if (env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
            or env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"):
        return None
    if cfg.otlp_endpoint is not None:
        source, raw = "telemetry.otlp_endpoint", cfg.otlp_endpoint
    else:
        got = _get(env, _PRE + "TRACES_ENDPOINT", _PRE + "ENDPOINT")
        if got is None:
            return None
        source, raw = got
    try:
        ep = split_endpoint(raw)
    except ValueError as e:
        raise ConfigError(source, str(e)) from None
    if ep.scheme is not None:
        tls = ep.scheme == "https"
    else:
        insecure = _get(env, _PRE + "TRACES_INSECURE", _PRE + "INSECURE")
        if insecure is not None:
            tls = insecure[1].lower() != "true"
        else:
            tls = source != "telemetry.otlp_endpoint"
    ca: str | None = None
    if cfg.otlp_ca_file is not None:
        if not tls:
            raise ConfigError("telemetry.otlp_ca_file",
                              f"is set but {source} is plaintext: write it as https://")
        ca = cfg.otlp_ca_file
    elif tls:
        got = _get(env, _PRE + "TRACES_CERTIFICATE", _PRE + "CERTIFICATE")
        ca = got[1] if got else None
    return TraceExport(endpoint=ep, tls=tls, ca_file=ca, ratio=sampling_ratio(cfg, env),
                       source=source, headers=export_headers(env))
