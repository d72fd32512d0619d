# A site: one member of the swarm made of the N ranks of a torchrun job (DDP or FSDP inside).
# Invariants: every rank runs a node of its own (its "lane") with the site's one identity and
# certificate, listening on the site's port + rank and dialling partner sites' port + rank, so
# lane r only ever meets lane r of other sites; rank 0's lane chooses every partner and tells
# the other lanes through the job's c10d store (under a prefix of this run), and they exchange
# their shares with the same partner site then and never start an exchange of their own; the
# ranks of a replicated (DDP) site hold the same model after every step of the user's loop (a
# rank whose share changed sends it to the others: one share at a time, never the whole model);
# a rank that fails a collective of the site ends the site's swarm on that rank (SiteBroken),
# and the others' collectives fail in turn, so the site leaves, for torchrun to restart it.
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import trio

from .._config import ConfigError, NodeConfig
from ..training import LoopClosed
from ._share import REPLICATED, SiteTrainer

log = structlog.get_logger()

# How often a follower asks the store whether rank 0 chose a partner: soon after the last one,
# then backing off while none comes (a store's wait() would block, but logs a C++ warning each
# time it times out)
FOLLOW_POLL_S = 0.02
FOLLOW_POLL_MAX_S = 0.16


class SiteBroken(LoopClosed):
    """A rank of this site failed (its collective raised): this rank's swarm was closed."""


def site_world() -> int:
    """The ranks of the torch.distributed job this process belongs to (1: not a site)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def lane_config(config: NodeConfig, rank: int, world: int) -> NodeConfig:
    """The node config of rank `rank`'s lane: the site's, with ports moved by `rank` (listen,
    advertise, bootstrap, metrics) and its own state directory `<state.dir>/rank<rank>`.

    Raises:
        ConfigError: a setting a site cannot run with (named).
    """
    net = config.network
    if config.gossip.algorithm != "adpsgd":
        raise ConfigError(f"gossip.algorithm = {config.gossip.algorithm!r}: a site of {world} "
                          "ranks (torchrun) runs adpsgd only")  # fmt: skip
    if not net.reachable:
        raise ConfigError(f"network.reachable = false: a site of {world} ranks must be "
                          "reachable (client mode is not supported for sites)")  # fmt: skip
    if _port(net.listen, "network.listen") == 0:
        raise ConfigError(f"network.listen = {net.listen!r}: a site of {world} ranks listens "
                          "on a fixed port, rank r on port + r (and dials partner sites' port "
                          "+ r): give a port, e.g. tcp://0.0.0.0:7000")  # fmt: skip
    network = dataclasses.replace(
        net, listen=_moved(net.listen, rank, "network.listen"),
        advertise=None if net.advertise is None else _moved(net.advertise, rank,
                                                            "network.advertise"),
        bootstrap=tuple(_moved(a, rank, "network.bootstrap") for a in net.bootstrap),
    )  # fmt: skip
    metrics = config.metrics
    if metrics.listen is not None and _port(metrics.listen, "metrics.listen"):
        metrics = dataclasses.replace(metrics, listen=_moved(metrics.listen, rank,
                                                             "metrics.listen"))  # fmt: skip
    state = dataclasses.replace(config.state, dir=Path(config.state.dir) / f"rank{rank}")
    return dataclasses.replace(config, network=network, metrics=metrics, state=state)


def _port(address: str, field: str) -> int:
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{field} = {address!r}: expected HOST:PORT (tcp://HOST:PORT)")
    return int(port)


def _moved(address: str, by: int, field: str) -> str:
    host, _, _ = address.rpartition(":")
    port = _port(address, field) + by
    if port > 65535:
        raise ConfigError(f"{field} = {address!r}: port + rank {by} is past 65535")
    return f"{host}:{port}"


class Site:
    """The torch.distributed side of one rank of a site: its group, the checks at join, the
    partner choice told between lanes, and the site sync of a replicated model.

    Made by `open_site` on every rank; one per joined swarm.
    """

    def __init__(self, rank: int, world: int, group: Any, data: Any, store: Any) -> None:
        self.rank, self.world = rank, world
        self.group = group  # the site's own gloo group (beside the user's DDP/FSDP one): flags
        self.data = data  # the shares' group: the job's backend (NCCL for CUDA tensors)
        self.store = store  # the job's c10d store, under this run's prefix
        self.trainer: SiteTrainer | None = None

    # -- at join -------------------------------------------------------------------------------
    def agree(self, ok: bool, what: str, peer_id: str | None = None) -> None:
        """Every rank says whether its part of the join went well (and, with `peer_id`, which
        identity it joins with); raises on every rank that did well when one did not, so that
        none waits on the others' collectives forever.

        Raises:
            RuntimeError: another rank failed (that rank raises its own error).
            ValueError: a rank joins with another identity than rank 0's.
        """
        if not ok:  # (told at once too: a rank still waiting for its node gives up)
            with contextlib.suppress(Exception):
                self.store.set("failed", f"rank {self.rank} failed {what}")
        said = torch.zeros(2, self.world, dtype=torch.int64)  # (failed, identity digest) by rank
        said[0, self.rank] = 0 if ok else 1
        if peer_id is not None:
            said[1, self.rank] = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:7],
                                                "big")  # fmt: skip
        dist.all_reduce(said, group=self.group)
        failed = [r for r in range(self.world) if said[0, r]]
        if not ok:
            return
        if failed:
            raise RuntimeError(f"rank(s) {failed} of this site failed {what} (see their "
                               "output): this rank stops too")  # fmt: skip
        other = [r for r in range(self.world) if said[1, r] != said[1, 0]]
        if peer_id is not None and other:
            raise ValueError(f"rank(s) {other} of this site joined with another identity than "
                             "rank 0's: every rank of a site joins with the site's one identity "
                             "(the same identity.key and certificate)")  # fmt: skip

    def failed_elsewhere(self) -> str | None:
        """Why this rank should give up its join: another rank failed (None: none did)."""
        try:
            if not self.store.check(["failed"]):
                return None
            return f"{self.store.get('failed').decode()} (see its output): this rank stops too"
        except Exception:  # (the store is gone: the job ends)
            return "the site's store is gone (its job ended)"

    def agree_step(self, trainer: SiteTrainer) -> None:
        """Every rank goes on from rank 0's step (a rank that resumed from an older checkpoint
        of its own would otherwise loop a different number of times, and its collectives wait
        forever)."""
        step = torch.tensor([trainer.step], dtype=torch.int64)
        dist.broadcast(step, src=0, group=self.group)
        if int(step) != trainer.step:
            log.warning("site_step_differs", rank=self.rank, step=trainer.step, site_step=int(step),
                        detail="this rank resumed at another step than rank 0: it goes on "
                        "from rank 0's step, with the model the site syncs now")  # fmt: skip
            trainer.step = int(step)

    # -- lanes ---------------------------------------------------------------------------------
    def lead_or_follow(self, algorithm: Any) -> None:
        """On the node's loop, once its algorithm exists: rank 0's partner choice tells the other
        lanes; another rank's lane exchanges only when told."""
        ctx = algorithm.ctx
        if self.rank == 0:
            ctx.peers = LeadingPeers(ctx.peers, self.store)
            return
        if not callable(getattr(algorithm, "exchange_once", None)):
            raise ConfigError("a site's lanes follow rank 0's exchanges: its algorithm must "
                              "have exchange_once (adpsgd)")  # fmt: skip
        ctx.peers = FollowingPeers(ctx.peers)
        ctx.start_soon(follow, algorithm, ctx.peers, self.store)

    # -- after each step of the user's loop --------------------------------------------------------
    def sync(self, trainer: SiteTrainer, *, force: bool = False) -> bool:
        """Bring every rank of a replicated site to the same model: each rank whose share
        changed since the last sync (a mix, a state sync) sends it to the others, one share at a
        time. A collective of the site group on every rank (the user's thread, between steps).
        Returns whether anything was sent. A sharded site has nothing to sync.

        Raises:
            SiteBroken: a rank of the site failed (its collective raised).
        """
        if trainer.layout != REPLICATED:
            return False
        device = trainer.task_device
        try:
            changed = torch.zeros(self.world, dtype=torch.int64)
            changed[self.rank] = 1 if (trainer.take_changed() or force) else 0
            dist.all_reduce(changed, group=self.group)
            owners = [r for r in range(self.world) if int(changed[r])]
            for owner in owners:
                if owner == self.rank:
                    flat = trainer.read_share()
                else:
                    flat = torch.empty(trainer.share_numel(owner), device=device,
                                       dtype=next(iter(trainer.shares[owner].values())).dtype)
                dist.broadcast(flat, src=owner, group=self.data)
                if owner != self.rank:
                    trainer.write_share(owner, flat)
                del flat
        except RuntimeError as exc:  # (gloo's and NCCL's errors: DistBackendError and others)
            raise SiteBroken(f"rank {self.rank}: a collective of this site failed (a rank "
                             f"died or stopped?): {exc}".strip()[:600]) from exc
        return bool(owners)


def open_site(rank: int, world: int) -> Site:
    """Make the site's group and store prefix (a collective: every rank calls it at join)."""
    group = dist.new_group(backend="gloo")  # (flags and ids, on the CPU)
    data = group if dist.get_backend() == "gloo" else dist.new_group()
    token = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    dist.broadcast(token, src=0, group=group)
    store = dist.PrefixStore(f"geotrain/{int(token)}/", _store_client())
    return Site(rank, world, group, data, store)


def _store_client() -> Any:
    """A client of the job's c10d store (torchrun's TCPStore) on a connection of its own: the
    lanes' polls never wait behind the user's own use of the store, nor it behind them."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False)
    return store  # (a FileStore or HashStore: shared as it is)


class LeadingPeers:
    """Rank 0's partner choice: the node's own, each partner told to the other ranks' lanes."""

    def __init__(self, peers: Any, store: Any) -> None:
        self._peers = peers
        self._store = store

    def choose_partner(self, now: float) -> str | None:
        partner = self._peers.choose_partner(now)
        if partner is not None:
            with contextlib.suppress(Exception):  # (the store is gone: the job ends)
                n = self._store.add("count", 1)
                self._store.set(f"x{n}", partner)
        return partner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peers, name)


class FollowingPeers:
    """Another rank's partner choice: the partner rank 0 chose, while told to exchange; none
    otherwise (so the lane's own pacing starts nothing)."""

    def __init__(self, peers: Any) -> None:
        self._peers = peers
        self.partner: str | None = None

    def dialable_peers(self) -> Any:
        return self._peers.dialable_peers() if self.partner is not None else ()

    def choose_partner(self, now: float) -> str | None:
        partner = self.partner
        return partner if partner is not None and self._peers.address_of(partner) else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peers, name)


async def follow(algorithm: Any, peers: FollowingPeers, store: Any) -> None:
    """Exchange with each partner rank 0's lane chooses, as it chooses them; one told while an
    exchange still runs is skipped (the newest is taken next). Ends when the store is gone
    (the job ends) or the node stops (its nursery is cancelled)."""
    done, poll_s = 0, FOLLOW_POLL_S
    while True:
        try:
            told = await trio.to_thread.run_sync(store.check, [f"x{done + 1}"])
            if not told:
                await trio.sleep(poll_s)
                poll_s = min(2 * poll_s, FOLLOW_POLL_MAX_S)
                continue
            poll_s = FOLLOW_POLL_S
            done = int(await trio.to_thread.run_sync(store.add, "count", 0))
            partner = await trio.to_thread.run_sync(store.get, f"x{done}")
        except (RuntimeError, ValueError) as exc:  # (the store's server ended with its job)
            log.info("site_follow_ended", reason=str(exc)[:200])
            return
        peers.partner = partner.decode()
        try:
            await algorithm.exchange_once()
        except LoopClosed:  # the user's loop ended while our mix waited for its next step
            return
        except Exception as exc:  # a bug must cost this exchange, not the node
            log.error("exchange_crashed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
        finally:
            peers.partner = None
