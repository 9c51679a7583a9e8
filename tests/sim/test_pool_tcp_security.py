"""What listens on TCP authenticates: the pool's RPC and rendezvous take a token (or an
explicit ``insecure``), and etcd's auth settings reach the etcd client. Real daemon
subprocesses, real sockets on 127.0.0.1, a real etcd with auth turned on."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from etcd_server import etcd_binary, etcd_server, tls_files
from pool_testing import Daemon

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool import connect
from kvfabric.pool.client.rpc import TokenRefused
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.gva.rendezvous import connect as rdv_connect
from kvfabric.pool.gva.rendezvous.client import RendezvousClient
from kvfabric.pool.gva.rendezvous.etcd import EtcdAuth, EtcdStore
from kvfabric.pool.gva.rendezvous.protocol import DECODER, HEADER, frame
from kvfabric.pool.gva.rendezvous.server import RendezvousServer
from kvfabric.pool.service.dispatch import Dispatcher
from kvfabric.pool.service.server import RpcServer

TOKEN = "t0ken-of-the-pool"
SERVE = [sys.executable, "-m", "kvfabric.cli", "pool", "serve"]


def test_a_tcp_listener_without_a_token_is_refused_unless_insecure(tmp_path):
    with pytest.raises(ValueError, match="insecure: true"):
        PoolConfig(tcp="127.0.0.1:0")
    assert PoolConfig(tcp="127.0.0.1:0", insecure=True).insecure
    assert PoolConfig(tcp="127.0.0.1:0", token=TOKEN).token == TOKEN
    d = Dispatcher.__new__(Dispatcher)  # the server refuses before it touches the dispatcher
    with pytest.raises(ValueError, match="needs a token"):
        RpcServer(d, str(tmp_path / "s.sock"), ("127.0.0.1", 0))
    r = subprocess.run(
        [*SERVE, "--dram", "0", "--tcp", "127.0.0.1:0", "--socket", str(tmp_path / "p.sock"), "--name", "s0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "insecure" in r.stderr and "token" in r.stderr, r.stderr
    assert not (tmp_path / "p.sock").exists()


def test_cluster_settings_are_checked_together(tmp_path):
    with pytest.raises(ValueError, match="leader_election needs rendezvous=etcd"):
        PoolConfig(leader_election=True, tcp="127.0.0.1:0", token=TOKEN)
    with pytest.raises(ValueError, match="tcp_advertise=HOST:PORT"):
        PoolConfig(leader_election=True, tcp="0.0.0.0:7000", token=TOKEN, rendezvous="etcd://e:2379")
    with pytest.raises(ValueError, match="etcd_cert and etcd_key go together"):
        PoolConfig(rendezvous="etcd://e:2379", etcd_cert=__file__)
    with pytest.raises(ValueError, match=r"etcd_ca='/nonexistent/ca\.pem': no such file"):
        PoolConfig(rendezvous="etcd://e:2379", etcd_ca="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="only used with rendezvous=etcd"):
        PoolConfig(etcd_user="u", etcd_password="p")
    cfg = PoolConfig(rendezvous="etcd://e:2379", etcd_user="u", etcd_password="pw")
    assert cfg.etcd_auth == EtcdAuth(user="u", password="pw") and cfg.effective()["etcd_password"] == "***"
    with pytest.raises(ValueError, match="etcd auth: cannot load ca"):
        EtcdAuth(ca=str(tmp_path)).ssl_context()


def test_a_client_with_a_wrong_token_is_refused_and_the_right_one_joins_over_tcp(tmp_path, isolated_shm):
    d = Daemon(tmp_path, name="sec1", dram="8MiB", extra={"tcp": "127.0.0.1:0", "token": TOKEN}).start()
    try:
        addr = f"127.0.0.1:{d.ready['tcp_port']}"
        t0 = time.monotonic()
        with pytest.raises(TokenRefused, match="refused the token"):
            connect(tcp=addr, token="wrong", timeout=2.0)
        with pytest.raises(TokenRefused, match="asks for a token"):
            connect(tcp=addr, timeout=2.0)  # no token at all
        assert time.monotonic() - t0 < 5
        c = connect(tcp=addr, token=TOKEN, local_reads=False)  # joins the rendezvous over TCP too
        try:
            assert c.session.fabric.store.url.startswith("kvf://")
            c.put("over-tcp", b"y" * 1000)
            assert c.get("over-tcp") == b"y" * 1000
        finally:
            c.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{d.ready['http_port']}/health", timeout=5) as r:
            assert json.loads(r.read())["ready"]  # the daemon kept serving
    finally:
        assert d.stop() == 0


def _raw(url: str) -> socket.socket:
    host, _, port = url[len("kvf://") :].rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _frame(sock: socket.socket) -> list | None:
    head = sock.recv(HEADER.size, socket.MSG_WAITALL)
    if len(head) < HEADER.size:
        return None
    return DECODER.decode(sock.recv(HEADER.unpack(head)[0], socket.MSG_WAITALL))


def test_the_rendezvous_server_authenticates_tcp_sessions_with_the_token(tmp_path):
    with pytest.raises(ValueError, match="needs a token"):
        RendezvousServer("0.0.0.0", 0)  # reachable from other hosts, no token
    RendezvousServer("0.0.0.0", 0, insecure=True)  # said so: allowed (not started)
    unix = str(tmp_path / "rdv.sock")
    with RendezvousServer(unix_path=unix, tcp=True, token=TOKEN) as srv:
        with pytest.raises(ValueError, match="requires a token"):
            RendezvousClient(srv.tcp_url)
        with pytest.raises(ValueError, match="refused the token"):
            RendezvousClient(srv.tcp_url, token="wrong")
        with rdv_connect(srv.tcp_url, token=TOKEN) as ok, rdv_connect(srv.url) as local:
            ok.set("k", b"v")
            assert local.get("k") == b"v"  # the Unix socket needs no token: one store behind both
        with _raw(srv.tcp_url) as s:  # skipping the challenge: refused, and the session ends
            s.sendall(frame([1, "hello", 0]))
            assert "challenge" in _frame(s)[2]
            s.sendall(frame([2, "set", "sneaky", b"x", False]))
            reply = _frame(s)
            assert reply[1] is False and "authenticate first" in reply[2][1]
            assert _frame(s) is None  # closed
        with rdv_connect(srv.url) as local:
            assert local.try_get("sneaky") is None


@pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (etcd-server)")
def test_etcd_user_and_password_pass_through_to_the_etcd_client():
    with etcd_server() as url:
        admin = EtcdStore(url)
        for path, body in (
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ):
            admin._post(path, body)
        admin.close()
        with pytest.raises(ServiceUnavailable):
            EtcdStore(url).set("x", b"1")
        with pytest.raises(ServiceUnavailable):
            EtcdStore(url, auth=EtcdAuth(user="root", password="wrong"))
        cfg = PoolConfig(rendezvous=url, etcd_user="root", etcd_password="rootpw")
        s = EtcdStore(url, auth=cfg.etcd_auth)
        try:
            s.set("x", b"1", ephemeral=True)  # a lease and a put under the auth token
            assert s.get("x") == b"1"
            assert s.watch_key("x", 0, 1.0)[0][0].value == b"1"
        finally:
            s.close()


@pytest.mark.skipif(etcd_binary() is None or not shutil.which("openssl"), reason="etcd or openssl missing")
def test_etcd_tls_settings_pass_through_to_the_etcd_client(tmp_path):
    """etcd serving HTTPS and asking for client certificates: the pool's etcd_ca /
    etcd_cert / etcd_key reach the client; without them it cannot talk to etcd."""
    tls = tls_files(str(tmp_path))
    with etcd_server(tls=tls) as url:
        with pytest.raises(ServiceUnavailable):
            EtcdStore(url, call_timeout=2.0)  # plain HTTP to an HTTPS port
        with pytest.raises(ServiceUnavailable):
            EtcdStore(url, call_timeout=2.0, auth=EtcdAuth(ca=tls["ca"]))  # no client certificate
        cfg = PoolConfig(
            rendezvous=url, etcd_ca=tls["ca"], etcd_cert=tls["client_cert"], etcd_key=tls["client_key"]
        )
        s = EtcdStore(url, auth=cfg.etcd_auth)
        try:
            s.set("tls/x", b"1", ephemeral=True)
            assert s.get("tls/x") == b"1"
            lease = s.grant(5)
            assert s.create_if_absent("tls/leader", b"me", lease)[0]
            assert s.watch_key("tls/leader", 0, 1.0)[0][0].value == b"me"
        finally:
            s.close()
