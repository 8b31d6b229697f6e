"""How the processor dials etcd: TLS, several endpoints, and password auth (decision 0013).

One gRPC channel per configured endpoint, so every endpoint's certificate is checked against
that endpoint's own host (an IPv4 or IPv6 literal against the certificate's IP names, a DNS
name against its DNS names), or against `etcd.tls.server_name` when set. Calls go to the
endpoint in use while its channel is connected; when it is not, to the next one that is. A
call that fails before it was sent anywhere (gRPC: no connection to any address) is
tried on the next endpoint within the same deadline, and so is one that a member refused
because it knows of no leader (every unary call asks for one: `hasleader`, answered before
anything is proposed); one that may have reached etcd is
never sent twice (a transaction may have applied), it fails and the next call goes to the
next endpoint.

With `etcd.auth`, the client authenticates (Auth.Authenticate) on first use and sends the
token as `token` metadata on every call. When etcd answers that the token is invalid (a
`simple` token idles out after `--auth-token-ttl`, a JWT expires, another member never saw
it) or that the auth store moved on, the client authenticates again and retries the call
once: etcd checks the token before it applies anything, so the retry cannot apply twice.

`EtcdClient.kv`, `.lease`, `.watch` have the shape of aetcd's generated stubs: a unary method
is awaited (`await client.kv.Range(req, timeout=...)`) and a streaming one iterated
(`async for r in client.watch.Watch(iter([req]))`), so the store's calls are unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from ..core.config import ConfigError, EtcdConfig

log = logging.getLogger("extproc.etcd")

_NOID = {"request_id": None, "attempt_id": None}

# gRPC's own words for a call that never left the client, no connection could be made
# (pick_first's and round_robin's).
_NOT_SENT = ("failed to connect to all addresses", "connections to all backends failing")
# Sent with every unary call: a member that knows of no leader answers at once with
# `etcdserver: no leader` (rpctypes.ErrGRPCNoLeader, checked before anything is proposed)
# instead of holding the call until its deadline, so the call goes to the next member.
_REQUIRE_LEADER = (("hasleader", "true"),)
_NO_LEADER = "etcdserver: no leader"
# etcd's answers to a token it no longer accepts (rpctypes.ErrGRPCInvalidAuthToken,
# ErrGRPCAuthOldRevision): authenticate again and retry.
_TOKEN_REJECTED = ("invalid auth token", "revision of auth store is old")
# A watch created with a bad token is not refused with an error: etcd answers created and
# canceled at once, with this reason (the same as a user lacking the permission).
_WATCH_DENIED = "permission denied"
_AUTH_NOT_ENABLED = "authentication is not enabled"

_STREAMS = frozenset({"LeaseKeepAlive", "Watch"})
_READY = grpc.ChannelConnectivity.READY
# After etcd refused our user or password, calls fail with that answer for this long before
# the next try: a wrong password must not become one bcrypt in etcd per request.
AUTH_HOLD_OFF_S = 1.0


@dataclass(frozen=True)
class Credentials:
    """What etcd.tls's and etcd.auth's files said at start-up."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    username: str | None = None
    password: str | None = None


def _read(field: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror or e}") from e
    if not data.strip():
        raise ConfigError(field, f"{path} is empty")
    return data


def _secret(field: str, path: str) -> str:
    # A Secret's file holds the value; a trailing newline (echo, a text editor) is not part
    # of it.
    try:
        text = _read(field, path).decode()
    except UnicodeDecodeError as e:
        raise ConfigError(field, f"{path} is not UTF-8 text") from e
    return text.rstrip("\r\n")


def read_credentials(cfg: EtcdConfig) -> Credentials:
    """Read every file etcd.tls and etcd.auth name; ConfigError naming the field and path."""
    tls, auth = cfg.tls, cfg.auth
    creds = Credentials()
    if tls.enabled:
        creds = Credentials(
            root_certificates=_read("etcd.tls.ca_file", tls.ca_file) if tls.ca_file else None,
            certificate_chain=(_read("etcd.tls.cert_file", tls.cert_file)
                               if tls.cert_file else None),
            private_key=_read("etcd.tls.key_file", tls.key_file) if tls.key_file else None)
    if auth.username_file is not None and auth.password_file is not None:
        creds = Credentials(
            root_certificates=creds.root_certificates,
            certificate_chain=creds.certificate_chain, private_key=creds.private_key,
            username=_secret("etcd.auth.username_file", auth.username_file),
            password=_secret("etcd.auth.password_file", auth.password_file))
    return creds


def _rpc_error(like: grpc.aio.AioRpcError, details: str,
               code: grpc.StatusCode | None = None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code or like.code(), like.initial_metadata(),
                                like.trailing_metadata(), details=details,
                                debug_error_string=like.debug_error_string())


def _new_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


# A member whose call timed out or that knew no leader is passed over for this long while
# another one is connected: a frozen member's channel stays READY (its kernel still holds
# the connection), so the channel's state alone would send calls back to it.
SUSPECT_S = 5.0


class _Endpoint:
    def __init__(self, index: int, address: str, channel: grpc.aio.Channel) -> None:
        self.index = index
        self.address = address
        self.channel = channel
        self.suspect_until = 0.0  # loop time
        self.stubs: dict[str, Any] = {
            "KV": rpc.KVStub(channel), "Lease": rpc.LeaseStub(channel),
            "Watch": rpc.WatchStub(channel), "Auth": rpc.AuthStub(channel)}
        # Every stub method by "Service.Method", looked up once per call.
        self.calls: dict[str, Any] = {f"{name}.{m}": fn for name, stub in self.stubs.items()
                                      for m, fn in vars(stub).items()}

    def state(self) -> grpc.ChannelConnectivity:
        return self.channel.get_state(try_to_connect=True)


class EtcdClient:
    """The channels to etcd's endpoints, the auth token, and stub-shaped services on them."""

    def __init__(self, cfg: EtcdConfig) -> None:
        self.cfg = cfg
        self.creds = read_credentials(cfg)  # at start-up: a missing file stops the process
        self._eps: list[_Endpoint] = []
        self._current = 0
        self._token: str | None = None
        # etcd answered "authentication is not enabled": calls go without a token until
        # etcd refuses one (auth was enabled since).
        self._tokenless = False
        self._auth_lock = asyncio.Lock()
        self._refused: tuple[float, grpc.aio.AioRpcError] | None = None  # (when, answer)
        self.authentications = 0  # how many times a token was obtained (tests, logs)
        # A unary call's metadata for the last token it was built for (built once, not
        # per call): (token, `hasleader` then `token`).
        self._unary_md: tuple[str | None, grpc.aio.Metadata] = (
            None, grpc.aio.Metadata(*_REQUIRE_LEADER))
        self.kv = _Service(self, "KV")
        self.lease = _Service(self, "Lease")
        self.watch = _Service(self, "Watch")

    # --- channels -----------------------------------------------------------------------

    def open(self) -> None:
        tls = self.cfg.tls
        options: list[tuple[str, Any]] = [
            # A DNS name with several addresses (a headless Service) spreads over them.
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.keepalive_time_ms", 10000),
            # gRPC's default reconnect backoff grows to 120 s: an etcd member back from an
            # outage would be ignored for up to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if tls.enabled and tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        creds = None
        if tls.enabled:
            c = self.creds
            creds = grpc.ssl_channel_credentials(root_certificates=c.root_certificates,
                                                 private_key=c.private_key,
                                                 certificate_chain=c.certificate_chain)
        for i, address in enumerate(self.cfg.endpoints):
            # `host:port` goes through gRPC's DNS resolver, which takes IPv4 and [IPv6]
            # literals as they are; the channel's authority (the name TLS checks) is the
            # endpoint's host.
            ch = (grpc.aio.secure_channel(address, creds, options=options) if creds is not None
                  else grpc.aio.insecure_channel(address, options=options))
            self._eps.append(_Endpoint(i, address, ch))

    async def close(self, grace: float | None = None) -> None:
        eps, self._eps = self._eps, []
        for ep in eps:
            await ep.channel.close(grace=grace)

    def pick(self, exclude: frozenset[int] = frozenset()) -> _Endpoint:
        """The endpoint in use if it is connected, else the next connected one.

        None connected: the first after it that is not failing (connecting, idle), else the
        first not excluded. Asking a channel's state also starts connecting it, so the other
        endpoints are ready when the one in use goes away.
        """
        eps = self._eps
        if not eps:
            raise _new_error(grpc.StatusCode.CANCELLED, "the etcd client is closed")
        n = len(eps)
        now = asyncio.get_running_loop().time()
        cur = eps[self._current]
        if (cur.index not in exclude and cur.suspect_until <= now
                and cur.channel.get_state(True) is _READY):  # cur.state(), one call less
            return cur
        fallback: int | None = None
        suspect: int | None = None
        for k in range(n):
            i = (self._current + k) % n
            if i in exclude:
                continue
            st = self._eps[i].state()
            if st == grpc.ChannelConnectivity.READY:
                if self._eps[i].suspect_until > now:
                    suspect = i if suspect is None else suspect
                    continue
                self._current = i
                return self._eps[i]
            if fallback is None and st != grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                fallback = i
        if fallback is None and suspect is not None:
            fallback = suspect  # every connected member is suspect: try one anyway
        if fallback is None:
            fallback = next((i % n for i in range(self._current, self._current + n)
                             if i % n not in exclude), self._current)
        self._current = fallback
        return self._eps[fallback]

    def move_on(self, ep: _Endpoint) -> None:
        """The call on `ep` failed in a way that may be the endpoint's: use the next one."""
        with contextlib.suppress(RuntimeError):
            ep.suspect_until = asyncio.get_running_loop().time() + SUSPECT_S
        if self._eps and self._current == ep.index and len(self._eps) > 1:
            self._current = (ep.index + 1) % len(self._eps)
            log.warning("etcd endpoint failing; using the next one",
                        extra={**_NOID, "endpoint": ep.address,
                               "next": self._eps[self._current].address})

    @property
    def endpoint_count(self) -> int:
        return len(self._eps)

    # --- auth ---------------------------------------------------------------------------

    async def token(self, ep: _Endpoint, timeout_s: float) -> str | None:
        """The token to send (None: no auth configured, or etcd has auth disabled)."""
        if self.creds.username is None or self._tokenless:
            return None
        if self._token is not None:
            return self._token
        async with self._auth_lock:
            if self._token is not None or self._tokenless:
                return self._token
            now = asyncio.get_running_loop().time()
            if self._refused is not None and now - self._refused[0] < AUTH_HOLD_OFF_S:
                raise _rpc_error(self._refused[1], self._refused[1].details() or "")
            user, password = self._secrets()
            try:
                resp = await ep.stubs["Auth"].Authenticate(
                    rpc.AuthenticateRequest(name=user, password=password), timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                if "authentication failed" in (e.details() or ""):
                    self._refused = (asyncio.get_running_loop().time(), e)
                if _AUTH_NOT_ENABLED in (e.details() or ""):
                    log.warning("etcd.auth is set but etcd has authentication disabled; "
                                "calling without a token", extra={**_NOID,
                                                                  "endpoint": ep.address})
                    self._tokenless = True
                    return None
                raise
            self._token = str(resp.token)
            self._refused = None
            self.authentications += 1
            return self._token

    def token_rejected(self, token: str | None) -> None:
        """etcd refused `token` (None: a call sent without one): get another next time."""
        if token is None:
            self._tokenless = False
        elif self._token == token:
            self._token = None

    def _secrets(self) -> tuple[str, str]:
        # Re-read at each authentication: a rotated Secret is picked up without a restart.
        auth = self.cfg.auth
        assert auth.username_file is not None and auth.password_file is not None
        assert self.creds.username is not None and self.creds.password is not None
        try:
            return (_secret("etcd.auth.username_file", auth.username_file),
                    _secret("etcd.auth.password_file", auth.password_file))
        except ConfigError as e:
            log.warning("cannot re-read etcd credentials; using the ones read at start-up",
                        extra={**_NOID, "error": str(e)})
            return self.creds.username, self.creds.password

    def metadata(self, token: str | None, extra: Any = None) -> tuple[tuple[str, str], ...] | None:
        md = tuple(extra or ())
        if token is not None:
            md += (("token", token),)
        return md or None

    def unary_metadata(self, token: str | None, extra: Any = None) -> Any:
        """A unary call's metadata: the caller's, `hasleader`, the token (in this order)."""
        if extra:
            return self.metadata(token, tuple(extra) + _REQUIRE_LEADER)
        md = self._unary_md
        if md[0] != token:
            md = self._unary_md = (token, grpc.aio.Metadata(
                *(self.metadata(token, _REQUIRE_LEADER) or ())))
        return md[1]

    # --- errors -------------------------------------------------------------------------

    def explain(self, e: grpc.aio.AioRpcError, ep: _Endpoint, authenticating: bool = False
                ) -> str:
        """gRPC's error, with the cause an operator can act on named first."""
        details = e.details() or ""
        tls, auth = self.cfg.tls, self.cfg.auth
        at = f"etcd at {ep.address}"
        cause = ""
        if "CERTIFICATE_VERIFY_FAILED" in details:
            roots = (f"etcd.tls.ca_file ({tls.ca_file})" if tls.ca_file
                     else "the system's roots (etcd.tls.ca_file is null)")
            cause = f"TLS: the certificate of {at} is not signed by a CA in {roots}"
        elif "Hostname Verification" in details or "hostname mismatch" in details.lower():
            name = tls.server_name or ep.address.rpartition(":")[0].strip("[]")
            cause = (f"TLS: the certificate of {at} is not valid for the name {name!r} "
                     "(etcd.tls.server_name overrides the name checked)")
        elif any(a in details for a in ("BAD_CERTIFICATE", "CERTIFICATE_REQUIRED",
                                        "HANDSHAKE_FAILURE", "UNKNOWN_CA")):
            cause = (f"TLS: {at} refused our client certificate etcd.tls.cert_file "
                     f"({tls.cert_file})" if tls.cert_file else
                     f"TLS: {at} requires a client certificate (etcd.tls.cert_file and "
                     "etcd.tls.key_file are not set)")
        elif "Tls handshake failed" in details or "WRONG_VERSION_NUMBER" in details:
            cause = f"TLS: the handshake with {at} failed (does it serve TLS?)"
        elif not tls.enabled and "Socket closed" in details:
            cause = (f"{at} closed the connection (if it serves TLS, set "
                     "etcd.tls.enabled: true)")
        elif authenticating and "authentication failed" in details:
            cause = (f"{at} refused the user or its password (etcd.auth.username_file "
                     f"{auth.username_file}, etcd.auth.password_file {auth.password_file})")
        elif authenticating:
            cause = f"authenticating to {at} failed"
        elif e.code() == grpc.StatusCode.PERMISSION_DENIED:
            cause = (f"{at} denied the user {self.creds.username!r} access to "
                     f"{self.cfg.prefix} (an etcd role must grant it readwrite)"
                     if auth.enabled else
                     f"{at} denied access (has etcd auth enabled? set etcd.auth."
                     "username_file and etcd.auth.password_file)")
        elif e.code() == grpc.StatusCode.UNAVAILABLE:
            cause = f"{at} is unreachable"
        return f"{cause}: {details}" if cause else f"{at}: {details}"


def _token_rejected(e: grpc.aio.AioRpcError) -> bool:
    d = e.details() or ""
    return any(m in d for m in _TOKEN_REJECTED)


def _no_leader(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.UNAVAILABLE and _NO_LEADER in (e.details() or "")


def _not_sent(e: grpc.aio.AioRpcError) -> bool:
    d = e.details() or ""
    return e.code() == grpc.StatusCode.UNAVAILABLE and any(m in d for m in _NOT_SENT)


class _Service:
    """Stub-shaped: `service.Method(request, timeout=...)` like aetcd's generated stubs."""

    def __init__(self, client: EtcdClient, name: str) -> None:
        self._client = client
        self._name = name

    def __getattr__(self, method: str) -> Any:
        # Called once per method name: the callable is then an attribute of its own.
        if method.startswith("_"):
            raise AttributeError(method)
        fn: Any
        if method in _STREAMS:
            def fn(requests: Any, timeout: float | None = None,
                   metadata: Any = None) -> _Stream:
                return _Stream(self._client, self._name, method, requests, timeout, metadata)
        else:
            path = f"{self._name}.{method}"

            def fn(request: Any, timeout: float | None = None, metadata: Any = None
                   ) -> Coroutine[Any, Any, Any]:
                return _unary(self._client, path, request, timeout, metadata)
        setattr(self, method, fn)
        return fn


_NONE: frozenset[int] = frozenset()


async def _unary(c: EtcdClient, path: str, request: Any, timeout_s: float | None,
                 metadata: Any) -> Any:
    """One unary call, `path` "Service.Method"."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (timeout_s if timeout_s is not None else c.cfg.timeout_s)
    reauthed = False
    tried = _NONE
    while True:
        ep = c.pick(tried)
        token, authenticating = None, True
        try:
            if c.creds.username is not None:
                token = await _token_within(c, ep, deadline - loop.time())
            authenticating = False
            left = deadline - loop.time()
            if left <= 0:
                raise _new_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "authenticating took the whole deadline")
            return await ep.calls[path](request, timeout=left,
                                        metadata=c.unary_metadata(token, metadata))
        except grpc.aio.AioRpcError as e:
            if not authenticating and not reauthed and (_token_rejected(e) or (
                    token is None and c._tokenless
                    and e.code() == grpc.StatusCode.PERMISSION_DENIED)):
                # Checked before anything applied: authenticate again, retry once.
                c.token_rejected(token)
                reauthed = True
                continue
            if _not_sent(e) or _no_leader(e):
                # Nothing was applied: the next member may take it within the deadline.
                tried = tried | {ep.index}
                c.move_on(ep)
                if len(tried) < c.endpoint_count and deadline - loop.time() > 0:
                    continue
            elif e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                c.move_on(ep)
            raise _rpc_error(e, c.explain(e, ep, authenticating)) from None


async def _token_within(c: EtcdClient, ep: _Endpoint, left: float) -> str | None:
    if c.creds.username is None:
        return None
    try:
        async with asyncio.timeout(max(left, 0.0)):
            return await c.token(ep, max(left, 0.001))
    except TimeoutError:
        raise _new_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"etcd at {ep.address}: no token within the deadline "
                         "(authenticating is slow, or another caller's attempt hung)") from None


class _Stream:
    """A streaming call like a grpc.aio one: iterate it for the responses; cancel() it.

    Opened on the first iteration. Until a first response arrived, a rejected token is
    replaced and the stream opened again once, and an endpoint that could not be reached
    is passed over for the next one, as for unary calls.
    """

    def __init__(self, client: EtcdClient, service: str, method: str, requests: Any,
                 timeout: float | None, metadata: Any) -> None:
        self._c = client
        self._service = service
        self._method = method
        # Only a finite, re-playable request list can be sent again; the store's are.
        self._requests: list[Any] | None = (
            list(requests) if isinstance(requests, Iterable) else None)
        self._async_requests = None if self._requests is not None else requests
        self._timeout = timeout
        self._metadata = metadata
        self._call: Any = None
        self._cancelled = False

    def cancel(self) -> bool:
        self._cancelled = True
        return bool(self._call.cancel()) if self._call is not None else True

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._run()

    async def _run(self) -> AsyncIterator[Any]:
        c = self._c
        reauthed = False
        tried: set[int] = set()
        while not self._cancelled:
            ep = c.pick(frozenset(tried))
            token, authenticating, first, call = None, True, True, None
            try:
                token = await _token_within(c, ep, c.cfg.timeout_s)
                authenticating = False
                requests = (iter(self._requests) if self._requests is not None
                            else self._async_requests)
                call = getattr(ep.stubs[self._service], self._method)(
                    requests, timeout=self._timeout,
                    metadata=c.metadata(token, self._metadata))
                self._call = call
                async for resp in call:
                    if (first and self._method == "Watch" and resp.canceled
                            and _WATCH_DENIED in resp.cancel_reason and token is not None
                            and not reauthed and self._requests is not None):
                        # Maybe only our token was stale: once with a fresh one.
                        c.token_rejected(token)
                        reauthed = True
                        break
                    first = False
                    yield resp
                else:
                    return
            except grpc.aio.AioRpcError as e:
                replayable = first and self._requests is not None
                if not authenticating and replayable and not reauthed and _token_rejected(e):
                    c.token_rejected(token)
                    reauthed = True
                    continue
                if (replayable or authenticating) and _not_sent(e):
                    tried.add(ep.index)
                    c.move_on(ep)
                    if len(tried) < c.endpoint_count:
                        continue
                elif e.code() in (grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED):
                    # As for unary calls: a frozen member's channel stays READY, so without
                    # this the next keep-alive would go to it again (the chaos harness saw a
                    # process lease lapse locally while two healthy members were there).
                    c.move_on(ep)
                if e.code() == grpc.StatusCode.CANCELLED and self._cancelled:
                    return
                raise _rpc_error(e, c.explain(e, ep, authenticating)) from None
            finally:
                if call is not None:
                    with contextlib.suppress(Exception):
                        call.cancel()
