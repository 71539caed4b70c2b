"""EtcdClient: configuration, retry/outage handling, failover, auth and TLS against real etcd servers."""

from __future__ import annotations

import threading
import time
import urllib.error

import pytest

from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.store import StoreAuthError, StoreRequestError, StoreUnavailableError
from resilient.core.errors import ConfigError

from .etcd_server import ROOT_PASSWORD, EtcdServer, _free_port

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_from_url_parses_hosts_and_tls() -> None:
    cfg = EtcdConfig.from_url("etcd://10.0.0.1:2379,10.0.0.2:3000,etcd-c", timeout_s=2.0)
    assert cfg.endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:3000", "http://etcd-c:2379")
    assert cfg.timeout_s == 2.0
    tls = EtcdConfig.from_url("etcds://h:2379", ca_file="/ca.pem", cert_file="/c.pem", key_file="/k.pem")
    assert tls.endpoints == ("https://h:2379",)


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("http://h:2379", {}, "store URL"),
        ("etcd://", {}, "store URL"),
        ("etcd://a:1,,b:2", {}, "host:port"),
        ("etcd://user:pw@h:1", {}, "host:port"),
        ("etcd://h:99999", {}, "invalid port"),
        ("etcd://h:1", {"username": "u"}, "together"),
        ("etcd://h:1", {"cert_file": "/c"}, "together"),
        ("etcd://h:1", {"ca_file": "/ca"}, "etcds://"),
        ("etcd://h:1", {"timeout_s": 0}, "timeout_s"),
        ("etcd://h:1", {"backoff_initial_s": 2.0, "backoff_max_s": 1.0}, "backoff"),
    ],
)
def test_bad_config_names_the_problem(url: str, options: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EtcdConfig.from_url(url, **options)


def test_unreachable_store_backs_off_then_raises_with_the_fix() -> None:
    clock = FakeClock()
    events: list[tuple[str, str]] = []
    port = _free_port()  # nothing listens: connection refused at once
    cfg = EtcdConfig.from_url(f"etcd://127.0.0.1:{port}", outage_tolerance_s=5.0, backoff_max_s=1.0)
    client = EtcdClient(cfg, on_outage=lambda *e: events.append(e), clock=clock, sleep=clock.sleep)
    with pytest.raises(StoreUnavailableError) as info:
        client.get("k")
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "outage_tolerance_s" in message and "ConnectionRefused" in message
    assert clock.sleeps[:6] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]  # doubling, capped
    assert sum(clock.sleeps) == pytest.approx(5.0)  # never sleeps past the tolerance
    assert [e[0] for e in events] == ["start"]
    # The outage is still on: the next call tries once and fails at once (no second 5 s wait).
    slept = len(clock.sleeps)
    with pytest.raises(StoreUnavailableError):
        client.put("k", b"v")
    assert len(clock.sleeps) == slept and [e[0] for e in events] == ["start"]


def test_failover_to_the_next_endpoint(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    events: list[tuple[str, str]] = []
    dead = f"127.0.0.1:{_free_port()}"
    cfg = EtcdConfig.from_url(f"etcd://{dead},{etcd_server.url[len('etcd://') :]}")
    client = EtcdClient(cfg, on_outage=lambda *e: events.append(e))
    client.put(f"{etcd_run_id}/k", b"v")
    assert client.get(f"{etcd_run_id}/k").value == b"v"  # type: ignore[union-attr]
    assert events == []  # one endpoint answering is not an outage


def test_leases_expire_keys_and_revoke_deletes_them(etcd_server: EtcdServer, etcd_run_id: str) -> None:
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    lease = client.lease_grant(30)
    client.put(f"{etcd_run_id}/a", b"1", lease=lease)
    assert client.get(f"{etcd_run_id}/a").lease == lease  # type: ignore[union-attr]
    assert 0 < client.lease_keepalive(lease) <= 30
    assert client.lease_revoke(lease) is True
    assert client.get(f"{etcd_run_id}/a") is None
    assert client.lease_revoke(lease) is False
    assert client.lease_keepalive(lease) == 0
    with pytest.raises(StoreRequestError, match="lease not found"):
        client.put(f"{etcd_run_id}/b", b"1", lease=lease)
    assert client.count_prefix(f"{etcd_run_id}/") == 0


def test_outage_is_survived_and_reported(etcd_outage_server: EtcdServer) -> None:
    events: list[tuple[float, str, str]] = []
    cfg = EtcdConfig.from_url(etcd_outage_server.url, outage_tolerance_s=30.0, backoff_max_s=0.2, timeout_s=2.0)
    client = EtcdClient(cfg, on_outage=lambda kind, detail: events.append((time.monotonic(), kind, detail)))
    done: list[tuple[float, int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop() -> None:
        i = 0
        try:
            while not stop.is_set():
                i += 1
                client.put("outage/k", str(i).encode())
                assert client.get("outage/k") is not None
                done.append((time.monotonic(), i))
                time.sleep(0.01)
        except Exception as e:  # noqa: BLE001  surfaced by the assertions below
            errors.append(e)

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        time.sleep(0.5)
        stopping_at = time.monotonic()  # before stop(): its SIGTERM may fail a request before it returns
        etcd_outage_server.stop()
        deadline = time.monotonic() + 30  # hang guards (the module's limit is 60 s), not how fast it must be
        while not events:  # the client reports the outage at its first failed request
            assert time.monotonic() < deadline, "the client never reported the outage"
            time.sleep(0.05)
        restarting_at = time.monotonic()
        etcd_outage_server.start()
        restarted_at = time.monotonic()
        deadline = time.monotonic() + 30
        while not any(t > restarted_at for t, _ in done) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert errors == []
    assert any(t > restarted_at for t, _ in done), "operations did not resume after etcd came back"
    assert [kind for _, kind, _ in events] == ["start", "end"], events
    assert stopping_at <= events[0][0] < restarting_at <= events[1][0]  # the outage, as the server had it
    assert "unreachable" in events[0][2] and "reachable again" in events[1][2]
    assert client.get("outage/k").value == str(done[-1][1]).encode()  # type: ignore[union-attr]


def test_auth_with_the_right_password_survives_token_expiry(etcd_auth_server: EtcdServer) -> None:
    cfg = EtcdConfig.from_url(etcd_auth_server.url, username="root", password=ROOT_PASSWORD)
    client = EtcdClient(cfg)
    client.put("auth/k", b"v")
    old_token = client._token
    time.sleep(3.0)  # the server's tokens live 2 s: the client must authenticate again, silently
    assert client.get("auth/k").value == b"v"  # type: ignore[union-attr]
    assert old_token and client._token and client._token != old_token  # it did re-authenticate
    with pytest.raises(urllib.error.HTTPError, match="401"):
        etcd_auth_server.gateway("/v3/kv/range", {"key": "YQ=="}, token=old_token)  # the old one is dead


def test_auth_with_a_wrong_password_is_a_clear_error(etcd_auth_server: EtcdServer) -> None:
    cfg = EtcdConfig.from_url(etcd_auth_server.url, username="root", password="wrong")
    with pytest.raises(StoreAuthError, match="refused user 'root'.*invalid user ID or password.*check the username"):
        EtcdClient(cfg).get("auth/k")


def test_auth_required_but_not_configured_is_a_clear_error(etcd_auth_server: EtcdServer) -> None:
    with pytest.raises(StoreAuthError, match="requires authentication.*give a username and password"):
        EtcdClient(EtcdConfig.from_url(etcd_auth_server.url)).get("auth/k")


def test_tls_with_client_certificate(etcd_tls_server: EtcdServer) -> None:
    tls = etcd_tls_server.tls
    assert tls is not None
    cfg = EtcdConfig.from_url(etcd_tls_server.url, ca_file=tls.ca_file, cert_file=tls.cert_file, key_file=tls.key_file)
    client = EtcdClient(cfg)
    client.put("tls/k", b"secret")
    assert client.get("tls/k").value == b"secret"  # type: ignore[union-attr]


def test_tls_unknown_ca_is_a_clear_error(etcd_tls_server: EtcdServer) -> None:
    tls = etcd_tls_server.tls
    assert tls is not None
    cfg = EtcdConfig.from_url(etcd_tls_server.url, cert_file=tls.cert_file, key_file=tls.key_file)
    with pytest.raises(StoreAuthError, match="TLS verification.*ca_file"):
        EtcdClient(cfg).get("tls/k")


def test_tls_missing_client_certificate_is_a_clear_error(etcd_tls_server: EtcdServer) -> None:
    tls = etcd_tls_server.tls
    assert tls is not None
    cfg = EtcdConfig.from_url(etcd_tls_server.url, ca_file=tls.ca_file, outage_tolerance_s=2.0)
    with pytest.raises(StoreAuthError, match="client certificate"):
        EtcdClient(cfg).get("tls/k")
    # Under TLS 1.3 etcd judges the certificate after the handshake and may close the connection before the
    # client reads its alert (an EOF, which once read as an outage here): one TLS 1.2 handshake tells them apart.
    client = EtcdClient(cfg)
    assert "CERTIFICATE" in (client._why_closed(cfg.endpoints[0]) or ""), "the 1.2 handshake hears the alert"
    full = EtcdClient(EtcdConfig.from_url(etcd_tls_server.url, ca_file=tls.ca_file, cert_file=tls.cert_file,
                                          key_file=tls.key_file))
    assert full._why_closed(cfg.endpoints[0]) is None  # with a certificate the handshake goes through
