"""A node's own membership certificate: warned about ahead of time, refused at start once expired,
no dialling storm at expiry, and a renewed file picked up without a restart."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

import geotrain
from geotrain.node import _certificate_watch as watch_module
from geotrain.node import config_from_toml
from geotrain.node._certificate_watch import CertificateWatch
from geotrain.node.identity import Admission, Identity, SwarmAuthority
from geotrain.node.state import render_status

CONFIG = """
[identity]
key = "{name}.key"
swarm = "swarm.json"
certificate = "{name}.cert.json"
[training]
task = "synthetic-linreg"
threads = 1
[gossip]
probe_interval_s = 0.2
exchange_every = 2
[state]
dir = "{name}-state"
status_every_s = 0.2
"""


def member(tmp_path: Path, authority: SwarmAuthority, name: str, expires_in_s: float,
           *overrides: str):  # fmt: skip
    identity = Identity.generate()
    identity.save(tmp_path / f"{name}.key")
    if not (tmp_path / "swarm.json").exists():
        authority.info.save(tmp_path / "swarm.json")
    cert = authority.admit(identity.public_key, expires_in_s=expires_in_s, now=time.time())
    cert.save(tmp_path / f"{name}.cert.json")
    return config_from_toml(CONFIG.format(name=name), base=tmp_path, overrides=list(overrides))


class FakeTransport:
    """Only what the watch reads and calls: the expiry in use and renew()."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    @property
    def certificate_expires_at(self) -> float:
        return float(self.admission.certificate.expires_at)

    def renew(self, admission: Admission) -> None:
        self.admission = admission


def test_warns_a_day_and_an_hour_ahead_then_says_it_expired(tmp_path):
    authority, identity = SwarmAuthority.generate(), Identity.generate()
    start = 1_800_000_000.0
    cert = authority.admit(identity.public_key, expires_in_s=2 * 86400, now=start)
    admission = Admission.with_certificate(authority.info, cert)
    now = [start]
    watch = CertificateWatch(FakeTransport(admission), identity, admission, None,
                             clock=lambda: now[0])  # fmt: skip
    events = []
    with capture_logs() as logs:
        for t in (0, 3600, 86400 + 10, 86400 + 20, 2 * 86400 - 1800, 2 * 86400 - 1000,
                  2 * 86400 + 1, 2 * 86400 + 100):  # fmt: skip
            now[0] = start + t
            watch.check()
            events.append([e["event"] for e in logs[len(sum(events, [])):]])
    assert events == [[], [], ["certificate_expires_soon"], [], ["certificate_expires_soon"], [],
                      ["certificate_expired"], []]  # fmt: skip
    expired = [e for e in logs if e["event"] == "certificate_expired"][0]
    assert "geotrain swarm admit" in expired["renew"] and identity.peer_id in expired["renew"]


def test_a_renewed_file_is_checked_before_it_is_used(tmp_path):
    authority, identity = SwarmAuthority.generate(), Identity.generate()
    now = time.time()
    cert = authority.admit(identity.public_key, expires_in_s=60, now=now)
    path = tmp_path / "me.cert.json"
    cert.save(path)
    admission = Admission.with_certificate(authority.info, cert)
    transport = FakeTransport(admission)
    watch = CertificateWatch(transport, identity, admission, path)
    forged = SwarmAuthority(authority.swarm_id, SwarmAuthority.generate().private_key)
    bad = [
        (forged.admit(identity.public_key, expires_in_s=3600, now=now), "authority"),
        (authority.admit(Identity.generate().public_key, expires_in_s=3600, now=now),
         "another key"),  # fmt: skip
        (authority.admit(identity.public_key, expires_in_s=10, now=now - 3600), "expired"),
    ]
    for i, (candidate, reason) in enumerate(bad):
        replace_file(candidate, path, i)
        with capture_logs() as logs:
            watch.check()
        assert transport.certificate_expires_at == cert.expires_at, reason
        assert logs[0]["event"] == "certificate_file_refused" and reason in logs[0]["reason"]
    path.write_text("not json")
    os.utime(path, (time.time() + 19, time.time() + 19))
    with capture_logs() as logs:
        watch.check()
    assert logs[0]["event"] == "certificate_file_refused"
    renewed = authority.admit(identity.public_key, expires_in_s=3 * 86400, now=now)
    replace_file(renewed, path, 20)
    with capture_logs() as logs:
        watch.check()
    assert transport.certificate_expires_at == renewed.expires_at
    assert [e["event"] for e in logs] == ["certificate_renewed"]


def replace_file(cert, path: Path, i: int = 0) -> None:
    """What an operator does: write the new file beside the old one and move it over it, with a
    distinct modification time (filesystems with coarse timestamps)."""
    fresh = path.with_suffix(".new")
    cert.save(fresh)
    t = time.time() + 10 + i
    os.utime(fresh, (t, t))
    fresh.replace(path)


async def test_an_expired_certificate_stops_a_node_at_start(tmp_path):
    authority = SwarmAuthority.generate()
    cfg = member(tmp_path, authority, "old", 1)
    await trio.sleep(1.5)
    expected = (r"identity.certificate = '.*old.cert.json': expired at "
                r".*\(geotrain swarm admit .* then start the node again")  # fmt: skip
    with pytest.raises(geotrain.ConfigError, match=expected):
        async with geotrain.open_node(cfg):
            pass


async def test_at_expiry_a_node_stops_dialling_and_resumes_with_a_renewed_file(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(watch_module, "CHECK_EVERY_S", 0.2)
    authority = SwarmAuthority.generate()
    b_cfg = member(tmp_path, authority, "b", 3600)
    with capture_logs() as logs:
        async with geotrain.open_node(b_cfg) as b:
            # (12 s: a must start, join b, sync and exchange twice before it expires, on a busy
            # CI box too; 4 s, rounded down to whole seconds, had left no room for that)
            a_cfg = member(tmp_path, authority, "a", 12, f'network.bootstrap=["{b.address}"]')
            async with geotrain.open_node(a_cfg) as a:
                with trio.fail_after(60):
                    while a.status().exchanges_ok < 2:
                        assert not any(e["event"] == "certificate_expired" for e in logs), (
                            "a's certificate expired before its second exchange")
                        await trio.sleep(0.1)
                    while not any(e["event"] == "certificate_expired" for e in logs):
                        await trio.sleep(0.1)
                expired_at = time.monotonic()
                # An exchange already under way at expiry may still finish (its frames passed the
                # admission check before it ended); none may start after it.
                await trio.sleep(1)
                ok_then = a.status().exchanges_ok
                await trio.sleep(5)  # a expired: what does it cost the swarm?
                window = time.monotonic() - expired_at
                refused = sum(1 for e in logs if e["event"] == "handshake_failed")
                assert a.status().exchanges_ok == ok_then
                print(f"after expiry: {refused} failed handshakes in {window:.0f} s")
                assert refused <= 12, f"{refused} failed handshakes in {window:.0f} s"
                assert a.status().certificate_expires_at < time.time()
                assert "certificate EXPIRED at" in render_status(a.status().to_json())
                # the operator renews: a picks the file up and trains with b again, no restart
                renewed = authority.admit(a.identity.public_key, expires_in_s=3600,
                                          now=time.time())  # fmt: skip
                replace_file(renewed, tmp_path / "a.cert.json")
                with trio.fail_after(60):
                    while a.status().exchanges_ok < ok_then + 2:
                        await trio.sleep(0.1)
                assert a.status().certificate_expires_at == renewed.expires_at
                assert "certificate expires" in render_status(a.status().to_json())
    events = [e["event"] for e in logs]
    assert "certificate_renewed" in events
