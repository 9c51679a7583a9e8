"""``EtcdStore``: the :class:`KVStore` contract on etcd v3, through its JSON gateway.

Talks HTTP to etcd's gRPC gateway (``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/txn``,
``/v3/kv/deleterange``, ``/v3/watch``, ``/v3/lease/*``; keys and values base64), so it
needs nothing beyond the standard library. URL: ``etcd://HOST:PORT`` (the client URL).

* ``add`` / ``append`` are compare-and-swap loops on the key's ``mod_revision``; ``cas``
  is one transaction comparing the value (or ``create_revision == 0`` for "absent").
* Ephemeral keys are attached to one lease per client (granted on first use, TTL
  ``ttl`` seconds, default 10: etcd cannot ask the process whether it is alive, so the TTL
  alone must outlast a starved process) that a thread keeps alive every ``ttl / 3``.
  A keep-alive that fails (one slow or refused HTTP request) is retried every
  ``min(ttl / 10, 0.5)`` s; the session is lost only when etcd says the lease is gone or
  no keep-alive has succeeded for ``ttl`` seconds (the lease has then expired anyway).
  ``close()`` revokes the lease, so the keys vanish at once; a process that dies or is
  stopped loses them when the lease expires.
* ``watch`` opens a streaming watch from ``after + 1`` and returns the first batch of
  events (or none at the timeout); a compacted revision raises ``Compacted``.
* Security (:class:`EtcdAuth`, passed as ``auth=``): a CA file turns the connection into
  HTTPS checked against it, a client certificate and key are presented when given
  (etcd's ``--client-cert-auth``), and a user and password are exchanged for an auth
  token (``/v3/auth/authenticate``) sent with every request and renewed when etcd
  refuses it as expired.
* Leases for others (``grant`` / ``keepalive_once`` / ``revoke``) and ``create_if_absent``
  (a transaction putting a key attached to a lease only while it does not exist) are the
  primitives the pool's leader election (``kvfabric.pool.service.leader``) builds on;
  they do not touch this session's own lease.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvfabric.errors import KeyNotFound, ServiceUnavailable
from kvfabric.pool.gva.rendezvous.base import (
    Compacted,
    KeyValue,
    KVStore,
    WatchEvent,
    check_key,
    check_value,
    decode_int,
)

DEFAULT_LEASE_TTL = 10.0  # seconds: sized for a loaded 2-core box (see module docstring)


class _AuthExpired(ServiceUnavailable):
    """etcd refused the request's auth token (none, or expired): authenticate again."""


def _auth_refusal(message: str) -> bool:
    """etcd's answer to a request without a valid auth token."""
    return "invalid auth token" in message or "user name is empty" in message


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _b64(b"\0")
    raw[-1] += 1
    return _b64(bytes(raw))


@dataclass(frozen=True)
class EtcdAuth:
    """How to reach a secured etcd: ``ca`` (PEM file: use HTTPS and check etcd's
    certificate against it), ``cert`` / ``key`` (PEM files of a client certificate),
    ``user`` / ``password`` (etcd's role-based auth). All empty: plain HTTP, no auth."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("etcd auth: cert and key go together (a client certificate and its key)")
        if bool(self.user) != bool(self.password):
            raise ValueError("etcd auth: user and password go together")

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of a connection to etcd (``ValueError`` naming a bad file)."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca or None)
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"etcd auth: cannot load ca={self.ca!r} cert={self.cert!r}: {e}") from e
        return ctx


class EtcdStore(KVStore):
    """A rendezvous session on an etcd cluster (see module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        ttl: float = DEFAULT_LEASE_TTL,
        call_timeout: float = 10.0,
        auth: EtcdAuth | None = None,
    ) -> None:
        if not url.startswith("etcd://"):
            raise ValueError(f"etcd address {url!r} must be etcd://HOST:PORT")
        host, _, port = url[len("etcd://") :].rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd address {url!r} must be etcd://HOST:PORT")
        if ttl < 1:
            raise ValueError(f"etcd lease ttl must be >= 1 s, got {ttl}")
        self.url, self.host, self.port = url, host, int(port)
        self.ttl = float(ttl)
        self.call_timeout = float(call_timeout)
        self.auth = auth or EtcdAuth()
        self._ssl = self.auth.ssl_context() if self.auth.tls else None
        self._auth_token = ""
        self._auth_lock = threading.Lock()
        self._local = threading.local()
        self._lease: int | None = None
        self._lease_lock = threading.Lock()
        self._lost: str | None = None
        self._closed = False
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if self.auth.user:
            self._authenticate()
        self._post("/v3/maintenance/status", {})  # fail now if nothing answers

    # ------------------------------------------------------------------ HTTP
    def _new_conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        t = self.call_timeout if timeout is None else timeout
        if self._ssl is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=t, context=self._ssl)
        return http.client.HTTPConnection(self.host, self.port, timeout=t)

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._new_conn()
            self._local.conn = c
        return c

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._auth_token:
            h["Authorization"] = self._auth_token
        return h

    def _authenticate(self) -> None:
        """Exchange the user and password for an auth token (sent with every request)."""
        with self._auth_lock:
            self._auth_token = ""
            r = self._request(
                "/v3/auth/authenticate", {"name": self.auth.user, "password": self.auth.password}
            )
            self._auth_token = str(r.get("token", ""))
            if not self._auth_token:
                raise ServiceUnavailable(f"etcd at {self.url}: authentication of {self.auth.user!r} failed")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check_session()
        try:
            return self._request(path, body)
        except _AuthExpired:
            if not self.auth.user:
                raise ServiceUnavailable(f"etcd at {self.url}: {path} needs authentication (user)") from None
            self._authenticate()
            return self._request(path, body)

    def _request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body)
        for attempt in (0, 1):
            c = self._conn()
            try:
                c.request("POST", path, data, self._headers())
                resp = c.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                c.close()
                self._local.conn = None
                if attempt:
                    raise ServiceUnavailable(f"etcd at {self.url}: {path} failed: {e}") from e
                continue
            out = json.loads(raw or b"{}")
            if resp.status != 200:
                msg = str(out.get("message") or out.get("error") or out)
                if resp.status == 401 or _auth_refusal(msg):
                    raise _AuthExpired(msg)
                raise ServiceUnavailable(f"etcd at {self.url}: {path} answered {resp.status}: {out}")
            return out
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ leases for others
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds (not this session's own); its id."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"etcd lease ttl must be an int >= 1 s, got {ttl!r}")
        return int(self._post("/v3/lease/grant", {"TTL": ttl})["ID"])

    def keepalive_once(self, lease: int) -> int:
        """Renew ``lease`` once; the TTL etcd granted from now (0: the lease is gone)."""
        r = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(r.get("result", {}).get("TTL", 0) or 0)

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: the keys attached to it are deleted."""
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    def create_if_absent(self, key: str, value: bytes, lease: int) -> tuple[bool, KeyValue | None, int]:
        """Put ``key`` attached to ``lease`` only if it does not exist (one transaction):
        ``(created, the key as it is now, store revision)``."""
        k = _b64(check_key(key))
        cmp = {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        put = {"request_put": {"key": k, "value": _b64(check_value(value)), "lease": str(lease)}}
        r = self._post(
            "/v3/kv/txn", {"compare": [cmp], "success": [put], "failure": [{"request_range": {"key": k}}]}
        )
        rev = int(r["header"]["revision"])
        if r.get("succeeded"):
            return True, KeyValue(key, value, rev), rev
        kvs = r.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        if not kvs:
            return False, None, rev
        kv = kvs[0]
        return False, KeyValue(key, _unb64(kv.get("value")), int(kv["mod_revision"])), rev

    def delete_if(self, key: str, value: bytes) -> bool:
        """Delete ``key`` only while it holds ``value`` (one transaction)."""
        k = _b64(check_key(key))
        cmp = {"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(check_value(value))}
        r = self._post("/v3/kv/txn", {"compare": [cmp], "success": [{"request_delete_range": {"key": k}}]})
        return bool(r.get("succeeded"))

    def watch_key(self, key: str, after: int, timeout: float | None) -> tuple[list[WatchEvent], int]:
        """Events of exactly ``key`` after revision ``after`` (the first batch, or none by
        ``timeout``)."""
        return self._watch(check_key(key), int(after), timeout, prefix=False)

    # ------------------------------------------------------------------ lease (ephemeral keys)
    def _lease_id(self) -> int:
        with self._lease_lock:
            if self._lease is None:
                r = self._post("/v3/lease/grant", {"TTL": max(round(self.ttl), 1)})
                self._lease = int(r["ID"])
                self._keeper = threading.Thread(
                    target=self._keepalive, name="kvfabric-etcd-lease", daemon=True
                )
                self._keeper.start()
            return self._lease

    def _keepalive(self) -> None:
        period = max(self.ttl / 3.0, 0.2)
        retry = min(self.ttl / 10.0, 0.5)
        deadline = time.monotonic() + self.ttl  # the lease was granted just now
        wait = period
        while not self._stop.wait(wait):
            sent = time.monotonic()
            try:
                r = self._post("/v3/lease/keepalive", {"ID": str(self._lease)})
            except ServiceUnavailable as e:
                if time.monotonic() >= deadline:
                    self._lost = f"lease keep-alive failed for {self.ttl:.0f} s: {e}"
                    return
                wait = retry  # one failed request is not a lost lease: try again soon
                continue
            left = int(r.get("result", {}).get("TTL", 0))
            if left <= 0:
                self._lost = "lease expired: ephemeral keys are gone"
                return
            deadline, wait = sent + left, period

    # ------------------------------------------------------------------ contract
    def set(self, key: str, value: bytes, *, ephemeral: bool = False) -> int:
        body: dict[str, Any] = {"key": _b64(check_key(key)), "value": _b64(check_value(value))}
        if ephemeral:
            body["lease"] = str(self._lease_id())
        return int(self._post("/v3/kv/put", body)["header"]["revision"])

    def _range(self, key: str, prefix: bool = False) -> tuple[list[KeyValue], int, list[dict[str, Any]]]:
        body: dict[str, Any] = {"key": _b64(key or "\0")}
        if prefix:
            body["range_end"] = _prefix_end(key) if key else _b64(b"\0")
        r = self._post("/v3/kv/range", body)
        raw = r.get("kvs", [])
        kvs = [
            KeyValue(_unb64(kv["key"]).decode(), _unb64(kv.get("value")), int(kv["mod_revision"]))
            for kv in raw
        ]
        return kvs, int(r["header"]["revision"]), raw

    def try_get(self, key: str) -> KeyValue | None:
        kvs, _, _ = self._range(check_key(key))
        return kvs[0] if kvs else None

    def get(self, key: str, timeout: float | None = 0.0) -> bytes:
        check_key(key)
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            kvs, rev, _ = self._range(key)
            if kvs:
                return kvs[0].value
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise KeyNotFound(f"etcd key {key!r} did not appear within {timeout} s")
            self._watch(key, rev, left, prefix=False)

    def _update(self, key: str, fn: Any) -> bytes:
        check_key(key)
        while True:
            kvs, _, raw = self._range(key)
            cur = kvs[0].value if kvs else None
            new = fn(cur)
            if raw:
                cmp = {
                    "key": _b64(key),
                    "result": "EQUAL",
                    "target": "MOD",
                    "mod_revision": raw[0]["mod_revision"],
                }
            else:
                cmp = {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(new)}
            if raw and raw[0].get("lease"):
                put["lease"] = raw[0]["lease"]
            r = self._post("/v3/kv/txn", {"compare": [cmp], "success": [{"request_put": put}]})
            if r.get("succeeded"):
                return new

    def add(self, key: str, delta: int = 1) -> int:
        if isinstance(delta, bool) or not isinstance(delta, int):
            raise TypeError(f"add needs an int delta, got {delta!r}")
        out = self._update(key, lambda cur: str(decode_int(cur, key) + delta).encode("ascii"))
        return int(out)

    def append(self, key: str, value: bytes) -> int:
        v = check_value(value)
        return len(self._update(key, lambda cur: (cur or b"") + v))

    def cas(self, key: str, expected: bytes | None, value: bytes | None) -> tuple[bool, bytes | None]:
        k = _b64(check_key(key))
        if expected is None:
            cmp = {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        else:
            cmp = {"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(check_value(expected))}
        if value is None:
            op = {"request_delete_range": {"key": k}}
        else:
            op = {"request_put": {"key": k, "value": _b64(check_value(value))}}
        r = self._post(
            "/v3/kv/txn", {"compare": [cmp], "success": [op], "failure": [{"request_range": {"key": k}}]}
        )
        if r.get("succeeded"):
            return True, value
        kvs = r.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        return False, (_unb64(kvs[0].get("value")) if kvs else None)

    def delete(self, key: str) -> bool:
        r = self._post("/v3/kv/deleterange", {"key": _b64(check_key(key))})
        return int(r.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        r = self._post(
            "/v3/kv/deleterange", {"key": _b64(check_key(prefix)), "range_end": _prefix_end(prefix)}
        )
        return int(r.get("deleted", 0))

    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        if not isinstance(prefix, str):
            raise TypeError(f"a rendezvous prefix is a str, got {type(prefix).__name__}")
        kvs, rev, _ = self._range(prefix, prefix=True)
        return sorted(kvs, key=lambda kv: kv.key), rev

    def watch(self, prefix: str, after: int, timeout: float | None) -> tuple[list[WatchEvent], int]:
        if not isinstance(prefix, str) or not prefix:
            raise TypeError("watch needs a non-empty str prefix")
        return self._watch(prefix, int(after), timeout, prefix=True)

    def _watch(
        self, key: str, after: int, timeout: float | None, *, prefix: bool
    ) -> tuple[list[WatchEvent], int]:
        self._check_session()
        req: dict[str, Any] = {"key": _b64(key), "start_revision": str(after + 1)}
        if prefix:
            req["range_end"] = _prefix_end(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self._new_conn()
        rev = after
        try:
            conn.request("POST", "/v3/watch", json.dumps({"create_request": req}), self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise ServiceUnavailable(f"etcd at {self.url}: watch answered {resp.status}")
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return [], rev
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                try:
                    line = resp.readline()
                except TimeoutError:
                    return [], rev
                if not line:
                    raise ServiceUnavailable(f"etcd at {self.url}: watch stream closed")
                msg = json.loads(line).get("result", {})
                rev = max(rev, int(msg.get("header", {}).get("revision", rev)))
                if int(msg.get("compact_revision", 0) or 0) > 0:
                    raise Compacted(f"etcd compacted revisions up to {msg['compact_revision']}")
                evs = msg.get("events")
                if evs:
                    out = []
                    for e in evs:
                        kv = e["kv"]
                        deleted = e.get("type") == "DELETE"
                        out.append(
                            WatchEvent(
                                _unb64(kv["key"]).decode(),
                                None if deleted else _unb64(kv.get("value")),
                                int(kv["mod_revision"]),
                            )
                        )
                    return out, max(rev, out[-1].revision)
        except (OSError, http.client.HTTPException) as e:
            raise ServiceUnavailable(f"etcd at {self.url}: watch failed: {e}") from e
        finally:
            conn.close()

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(5)
        if self._lease is not None and self._lost is None:
            try:
                self._post("/v3/lease/revoke", {"ID": str(self._lease)})
            except ServiceUnavailable:
                pass
        self._closed = True
        self._lost = "client closed"
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()

    def __repr__(self) -> str:
        return f"EtcdStore({self.url})"
