# geotrain as a library: a node beside the user's own training loop. Invariants: the node runs
# its trio loop in one background thread and owns the network; the user's thread owns the model,
# and the wrapped optimizer's step is the only point where the two meet (the node's pending
# changes run there, after the user's optimizer); step() never waits on the network; close() (or
# leaving the `with` block, Ctrl-C included) stops the node cleanly: last checkpoint, leave; a
# swarm left open when the program ends is closed at exit, and a join interrupted while it waits
# (Ctrl-C) stops its node before the interruption goes on: the node's thread never outlives the
# interpreter (nng aborted the process when it did), and a second Ctrl-C while the node stops
# waits for it too; a process forked from the user's leaves the parent's swarms alone.
from __future__ import annotations

import atexit
import contextlib
import numbers
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
import trio

from ._config import ConfigError, NodeConfig, config_from_toml, load_config
from ._credentials import load_identity
from ._node import Node
from ._signals import default_sigterm, exit_on_sigterm
from ._state_sync import ModelMismatch
from .cli import configure_logging, launched_config
from .identity import Admission, Identity
from .site import (
    SHARDED,
    Site,
    SiteBroken,
    SiteTrainer,
    lane_config,
    open_site,
    site_module,
    site_world,
)
from .state import NodeStatus
from .training import (
    Diverged,
    LoopClosed,
    LoopTrainer,
    StepResult,
    exits_deferred,
    take_deferred_exit,
)


class Swarm:
    """A node training the user's model with the user's loop. Made by `geotrain.join`.

    Use `wrap` on the model's optimizer; call `close` (or use `with`) when done.
    """

    def __init__(self, node: Node, loop: LoopTrainer, thread: threading.Thread,
                 token: trio.lowlevel.TrioToken, box: dict[str, Any]) -> None:  # fmt: skip
        self.node = node
        self._loop = loop
        self._thread = thread
        self._token = token
        self._box = box  # "error": what ended the node's thread, if anything did
        self._closed = False
        self._pid = os.getpid()  # a forked child has no node thread: it leaves this one alone
        self._joined_digest = loop.sample_digest()  # the model as join left it (never_wrapped)
        self._stepping = 0  # > 0 while a SwarmOptimizer steps (its optimizer's step is not raw)
        self._raw_hook: Any = None  # the hook on the wrapped optimizer that sees raw steps
        self._said: set[str] = set()  # the MisuseWarnings given (each once)
        self._site: Site | None = None  # one rank of a torchrun site (geotrain.node.site)

    def check_alive(self) -> None:
        """Raise if the node stopped by itself (an error in it): the user's loop would otherwise
        train alone without knowing.

        Raises:
            LoopClosed: the node is gone; the error that ended it is the cause.
        """
        if self._closed or self._thread.is_alive():
            return
        error = self._box.get("error")
        leaf = None if error is None else _leaf(error)  # (the cause: not trio's group around it)
        raise LoopClosed(f"the geotrain node stopped: {leaf!r}" if leaf is not None
                         else "the geotrain node stopped") from leaf  # fmt: skip

    @property
    def address(self) -> str | None:
        return self.node.address

    @property
    def peer_id(self) -> str:
        return self.node.identity.peer_id

    @property
    def step(self) -> int:
        return self._loop.step

    @property
    def metrics_port(self) -> int | None:
        """The port of the Prometheus endpoint ([metrics] listen), or None without one."""
        return None if self.node.metrics is None else self.node.metrics.port

    def wrap(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> SwarmOptimizer:
        """The user's optimizer, made to take part in the swarm at each `step()`.

        Its state (and the scheduler's, if given) is restored from the node's checkpoint when
        there is one, and saved in the node's checkpoints from now on. A node that took its
        model from a peer at join fetches that peer's optimizer state here, when the peer's
        optimizer is of the same class (wrap waits for it; another class fetches nothing).

        Wrapping the same optimizer again (or what wrap returned) with a scheduler adds that
        scheduler, e.g. one made on what the first wrap returned.

        Raises:
            ValueError: not a torch optimizer, the optimizer steps parameters that are not
                the joined model's, or trains one that was frozen at join.
            LoopClosed: the swarm is closed.
        """
        if self._closed:
            raise LoopClosed("wrap() after the swarm was closed")
        if isinstance(optimizer, SwarmOptimizer):  # (wrapped again, e.g. to add a scheduler
            optimizer = optimizer.optimizer  # made on what the first wrap returned)
        self._loop.attach(optimizer, scheduler)
        self.node.measure_optimizer(optimizer)
        if self._raw_hook is None:
            self._raw_hook = _step_hook(optimizer, self._raw_step)
        self._check_unstepped(optimizer)
        return SwarmOptimizer(self, optimizer, scheduler)

    def _check_unstepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Parameters that were trainable at join (so exchanged at every exchange) but that the
        wrapped optimizer does not step: a base the user meant to freeze travels whole."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        idle = [(n, p) for n, p in self._loop.model.named_parameters()  # (frozen since join:
                if n in self._loop.params() and p.requires_grad  # frozen_after_join says it)
                and id(p) not in stepped]  # fmt: skip
        if idle:
            values = sum(p.numel() for _, p in idle)
            self.misuse("unstepped", f"{len(idle)} parameter(s) ({values:,} values, e.g. "
                        f"{idle[0][0]!r}) trainable at join are not in the wrapped optimizer: "
                        "they are exchanged and averaged all the same, and never trained. "
                        "Freeze what does not train before geotrain.join "
                        "(module.requires_grad_(False)), or give it to the optimizer")  # fmt: skip

    def _raw_step(self, *_: Any) -> None:
        """The wrapped optimizer's step hook: a step not taken through what wrap returned."""
        if not self._stepping and not self._closed:
            self.misuse("raw_step", "the optimizer given to swarm.wrap() was stepped directly: "
                        "that step was not shared with the swarm, and the mixes that arrived "
                        "wait until a step through the wrapped one. Step what wrap returned: "
                        "opt = swarm.wrap(optimizer); opt.step()")  # fmt: skip

    def misuse(self, key: str, message: str) -> None:
        """Say `message` once per swarm as a MisuseWarning, pointing at the user's line."""
        if key not in self._said:
            self._said.add(key)
            warnings.warn(message, MisuseWarning, stacklevel=_user_stacklevel())

    def _check_unpassed_scheduler(self, optimizer: torch.optim.Optimizer) -> None:
        """A learning-rate scheduler made on the optimizer (torch's put `initial_lr` in its
        groups) but not passed to wrap is not checkpointed nor synced: say so."""
        if self._loop.scheduler is None and "scheduler" not in self._said and any(
                "initial_lr" in group for group in optimizer.param_groups):  # fmt: skip
            self.misuse("scheduler", "a learning-rate scheduler schedules the wrapped optimizer "
                        "but was not passed to swarm.wrap(): its point in the schedule is "
                        "neither checkpointed nor taken from the swarm, so a resume or a late "
                        "joiner starts it over (its warmup again). Pass it: "
                        "opt = swarm.wrap(optimizer, scheduler)")  # fmt: skip

    def _notify(self, result: StepResult) -> None:
        """Hand a step to the node's loop without waiting for it (the step channel is unbounded:
        the loop's thread never blocks on the node's)."""
        steps = self.node.steps
        if steps is None:
            return

        def send() -> None:  # on the node's loop: an exception here would end it
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                steps.send_nowait(result)

        try:
            self._token.run_sync_soon(send)
        except trio.RunFinishedError:
            pass  # the node stopped (a signal, an error): the loop's steps go on unheard

    def status(self) -> NodeStatus:
        """The node's status now (what `geotrain status` shows).

        Raises:
            LoopClosed: the swarm is closed, or its node has stopped (its last status is in
                state.dir's status.json).
        """
        if self._closed:
            raise LoopClosed("status() after the swarm was closed (its last status is in "
                             f"{self.node.state.status})")  # fmt: skip
        try:
            return trio.from_thread.run_sync(self.node.status, trio_token=self._token)
        except trio.RunFinishedError:
            raise LoopClosed("status(): the geotrain node has stopped (its last status is in "
                             f"{self.node.state.status})") from None  # fmt: skip

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop the node cleanly (checkpoint, leave the swarm) and wait for it. Idempotent.

        Raises:
            LoopClosed: the node had failed (its error is the cause): its last checkpoint and
                status may be older than the loop's last step.
        """
        if self._closed:
            return
        self._closed = True
        _open_swarms.discard(self)
        if self._raw_hook is not None:
            self._raw_hook.remove()
        if os.getpid() != self._pid:  # a forked child: the node runs in the parent, not here
            return
        self._warn_never_wrapped()  # (first: the loop's close applies the mixes that came)
        early: BaseException | None = None
        with exits_deferred():  # (join's SIGTERM exit is raised once the node has stopped)
            try:
                self._loop.close()
            except (KeyboardInterrupt, SystemExit) as exc:  # (Ctrl-C, a handler of the
                # program's own: the node is stopped all the same)
                early = exc
            interrupted = _stop_and_wait(self._token, self._stop, self._box, timeout_s) or early
            _default_sigterm()  # (once stopped, and no swarm is open: SIGTERM's default again)
        deferred = take_deferred_exit()
        interrupted = interrupted or deferred
        error = self._box.pop("error", None)
        if self._site is not None and interrupted is None and error is None:
            # the mixes that came while the node stopped changed one rank's share only: the
            # site's ranks hold one model again (every rank closes after the same step)
            self._site.sync(self._loop)  # type: ignore[arg-type]
        if interrupted is not None:  # (after the node stopped: see _stop_and_wait)
            raise interrupted
        if error is not None:
            raise LoopClosed(f"the geotrain node had failed: {_leaf(error)!r}") from _leaf(error)

    def _site_step(self) -> None:
        """After each step of a site's rank: the site's ranks hold one model again (a share
        that changed on one rank goes to the others). A rank that failed ends the swarm here.

        Raises:
            SiteBroken: a rank of the site failed; this rank's swarm was closed first.
        """
        assert self._site is not None and isinstance(self._loop, SiteTrainer)
        try:
            self._site.sync(self._loop)
        except SiteBroken:
            self._site = None  # (no last sync in close: the site is broken)
            with contextlib.suppress(Exception):
                self.close()
            raise

    def _warn_never_wrapped(self) -> None:
        """The model changed since join with no optimizer wrapped: the loop trained alone."""
        try:
            changed = (self._loop.optimizer is None
                       and self._loop.sample_digest() != self._joined_digest)  # fmt: skip
        except Exception:  # (a device in an error state: the stop below matters more)
            return
        if changed:
            structlog.get_logger().warning(
                "never_wrapped", detail="the model trained, but no optimizer was passed to "
                "swarm.wrap(): its steps were not shared with the swarm, and it took nothing "
                "from it (opt = swarm.wrap(optimizer), then opt.step())")  # fmt: skip

    def _stop(self) -> None:
        if self.node.steps is not None:
            self.node.steps.close()
        self.node.request_stop()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # a site's last sync waits on every rank: not on the way out of
            self._site = None  # an error (this rank's alone, or the site's)
        self.close()


class SwarmOptimizer(torch.optim.Optimizer):
    """The user's optimizer inside a swarm: `step()` is the optimizer's step, then the mixes that
    arrived meanwhile, then the swarm is told (exchanges start per the algorithm, in the
    background). Everything else (zero_grad, param_groups, state_dict, ...) is the optimizer's.

    An Optimizer to torch and to other libraries (a learning-rate scheduler built on it after
    `wrap`, an isinstance check), without Optimizer's own state: its constructor is not run, and
    each of its methods but `step` is the wrapped optimizer's.
    """

    def __init__(self, swarm: Swarm, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        # (no super().__init__: the parameters, groups, state and hooks are the optimizer's)
        self._swarm = swarm
        self.optimizer = optimizer
        self.scheduler = scheduler

    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> Any:
        """The optimizer's step. `loss` (a tensor or number) is reported in the node's status.

        Raises:
            LoopClosed: after the swarm was closed, or when its node stopped by itself (the
                node's error is the cause).
        """
        swarm = self._swarm
        swarm.check_alive()
        value = None if loss is None else _loss_value(loss)
        swarm._stepping += 1
        try:
            result, stepped = swarm._loop.stepped(lambda: self.optimizer.step(closure), value)
        except Diverged as exc:  # the step was taken: the node hears of it, then the user
            if exc.result is not None:
                swarm._notify(exc.result)
            raise
        finally:
            swarm._stepping -= 1
        swarm._notify(stepped)
        if swarm._site is not None:
            swarm._site_step()
        swarm._check_unpassed_scheduler(self.optimizer)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:  # (what Optimizer's class does not define)
        return getattr(self.optimizer, name)

    # what torch.amp.GradScaler hands a fused optimizer for its step (set, then deleted), on the
    # object it was given: the wrapped optimizer must see them, or it steps on scaled gradients
    _FOR_THE_OPTIMIZER = frozenset({"grad_scale", "found_inf"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._FOR_THE_OPTIMIZER:
            setattr(self.optimizer, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._FOR_THE_OPTIMIZER:
            delattr(self.optimizer, name)
        else:
            super().__delattr__(name)

    def __repr__(self) -> str:
        return f"SwarmOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a SwarmOptimizer is not picklable (it holds a swarm): pickle its "
                        "`optimizer`, or save state_dict()")  # fmt: skip


for _name in ("register_step_pre_hook", "register_step_post_hook",
              "register_state_dict_pre_hook", "register_state_dict_post_hook",
              "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook"):
    def _delegate(self, *args, _name=_name, **kwargs):
        return getattr(self.optimizer, _name)(*args, **kwargs)

    _delegate.__name__ = _name
    _delegate.__doc__ = f"The wrapped optimizer's {_name}."
    setattr(SwarmOptimizer, _name, _delegate)


def join(
    config: str | Path | NodeConfig | torch.nn.Module | None = None,
    model: torch.nn.Module | None = None,
    *,
    overrides: Sequence[str] = (),
    evaluate: Callable[[torch.nn.Module], float] | None = None,
    metric: str = "metric",
    higher_is_better: bool = True,
    identity: Identity | Mapping[str, Any] | None = None,
    admission: Admission | None = None,
    ready_timeout_s: float | None = None,
    network: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
    gossip: Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    privacy: Mapping[str, Any] | None = None,
) -> Swarm:
    """Join the swarm a node config describes, training `model` with your own loop.

        swarm = geotrain.join(model)  # under `geotrain local -n 3 -- python train.py`
        swarm = geotrain.join("node.toml", model, gossip={"algorithm": "diloco"})
        opt = swarm.wrap(torch.optim.AdamW(model.parameters(), lr=3e-4))
        ...  # your loop: opt.step() takes part in the swarm
        swarm.close()  # or: with geotrain.join(...) as swarm:

    Under torchrun (an initialized torch.distributed job of N > 1 ranks), every rank calls
    join with its DistributedDataParallel or fully_shard-ed model and the same config: the job
    joins as one site, rank r exchanging its share of the model with rank r of the partner
    sites (docs/how-to/multi-gpu-sites.md).

    Returns once the node listens, knows `training.wait_for_peers` peers and (with no checkpoint
    of its own) has fetched the current model from one of them. Ctrl-C while it waits stops the
    node before the KeyboardInterrupt goes on; a swarm still open when the program ends is
    closed then. Logs go to standard error (info and above) unless the program configured
    structlog itself.

    Args:
        config: a node config file (TOML) or a NodeConfig; its [training] task is not used.
            Left out (`join(model)`): the config `geotrain local` made for this process, or
            else only the settings given here (with `identity` and `admission` objects, or an
            identity.key file in the working directory).
        model: the model your loop trains (same parameter names and shapes on every peer).
            Its parameters that require grad now are averaged; those frozen now (a fine-tuned
            model's base) are not sent: every peer must load the same frozen values.
        network, training, gossip, state, limits, metrics, privacy: settings of that
            section of the node config, as a dict of its keys with Python values (e.g.
            gossip={"algorithm": "diloco", "diloco": {"inner_steps": 50}}), set over the
            config file's; a dict given as `identity` sets the [identity] section.
        overrides: `section.key=value` items (TOML values), set last: over the file's and the
            keyword settings.
        evaluate / metric / higher_is_better: a held-out metric for the node's status and
            checkpoints' log (the loss is reported when none is given).
        identity, admission: an Identity and Admission given directly instead of the
            config's files.
        ready_timeout_s: give up waiting for the node after this long (None: wait).

    Raises:
        ConfigError: a bad config, setting or identity files (before anything starts), or a
            model that does not fit limits.memory_gb. ModelMismatch (a ConfigError): the
            swarm's peers refuse this model as another one. ResumeError: the state directory
            holds another algorithm's checkpoint. TimeoutError: not ready in `ready_timeout_s`.
            ValueError: a model without parameters, or with every one frozen (requires_grad
            False), or one an open swarm of this process trains already; under torchrun, a
            model neither DDP-wrapped nor fully_shard-ed, or ranks of other identities.
            RuntimeError: under torchrun, another rank of the site failed to join.
    """
    if isinstance(config, torch.nn.Module) and model is None:  # join(model)
        config, model = None, config
    if isinstance(identity, Mapping):
        settings_identity, identity = identity, None
    else:
        settings_identity = None
    sections = {"identity": settings_identity, "network": network, "training": training,
                "gossip": gossip, "state": state, "limits": limits, "metrics": metrics,
                "privacy": privacy}  # fmt: skip
    settings = {name: values for name, values in sections.items() if values is not None}
    config, made_here = _config_of(config, overrides, settings)
    if not isinstance(model, torch.nn.Module) or not any(True for _ in model.parameters()):
        raise ValueError(f"model {type(model).__name__}: expected a torch.nn.Module with "
                         "parameters (there is nothing to train or average)")  # fmt: skip
    inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper: its names would all
    if isinstance(inner, torch.nn.Module):  # begin '_orig_mod.', unlike an uncompiled peer's or
        model = inner  # checkpoint's; it trains the same parameters
    world = site_world()
    if world > 1:  # under torchrun: this process is one rank of a site
        return _join_site(model, world, config, made_here, identity, admission, ready_timeout_s,
                          evaluate, metric=metric, higher_is_better=higher_is_better)
    _refuse_joined_twice(model)
    loop = LoopTrainer(model, evaluate, metric=metric, higher_is_better=higher_is_better)
    identity, admission = _identity_of(config, made_here, identity, admission)
    node, thread, box, ready = _start_node(config, identity, admission, loop)
    try:  # (here, not in _start_node: a refusal's traceback is join's and its wait's alone)
        _wait_ready(node, thread, ready, box, ready_timeout_s)
    except BaseException:
        _default_sigterm()
        raise
    loop.start()
    swarm = Swarm(node, loop, thread, box["token"], box)
    _open_swarms.add(swarm)
    return swarm


def _identity_of(config: NodeConfig, made_here: bool, identity: Identity | None,
                 admission: Admission | None) -> tuple[Identity, Admission]:  # fmt: skip
    """The identity and admission given, or else the config's files."""
    if identity is not None and admission is not None:
        return identity, admission
    try:
        return load_identity(config)
    except ConfigError as exc:
        if not made_here:
            raise
        raise _no_file(exc) from None


def _start_node(
    config: NodeConfig, identity: Identity, admission: Admission, loop: LoopTrainer
) -> tuple[Node, threading.Thread, dict[str, Any], threading.Event]:
    """Start the node of `loop` in a thread of its own; the event is set once it is ready (or
    failed: see _wait_ready). SIGTERM exits the program from now on (_default_sigterm puts it
    back when the start fails)."""
    if not structlog.is_configured():  # (its defaults print every debug line to stdout)
        configure_logging("info", "auto")
    ready = threading.Event()
    box: dict[str, Any] = {"ended": threading.Event()}  # set as the node's trio loop returns
    node = Node(config, identity, admission, loop=loop, on_ready=ready.set)

    async def main() -> None:
        box["token"] = trio.lowlevel.current_trio_token()
        try:
            await node.run()
        except BaseException as exc:  # told to the user's thread; the node is gone anyway
            box["error"] = exc
            ready.set()

    def run() -> None:
        try:
            trio.run(main)
        finally:
            box["ended"].set()

    thread = threading.Thread(target=run, name="geotrain-node", daemon=True)
    exit_on_sigterm()
    thread.start()
    return node, thread, box, ready


def _join_site(model: torch.nn.Module, world: int, config: NodeConfig, made_here: bool,
               identity: Identity | None, admission: Admission | None, timeout_s: float | None,
               evaluate: Callable[[torch.nn.Module], float] | None,
               **kwargs: Any) -> Swarm:  # fmt: skip
    """join() on one rank of a torchrun site (see geotrain.node.site): every rank calls it, and
    each step of the way is agreed, so that a rank that fails makes every rank raise instead
    of waiting on it."""
    import torch.distributed as dist

    rank = dist.get_rank()
    site = open_site(rank, world)
    try:
        model, layout = site_module(model)
        if layout == SHARDED and evaluate is not None:
            raise ValueError("evaluate: a sharded (FSDP) site's forward pass is a collective of "
                             "all its ranks, which one rank's node cannot run alone: report the "
                             "loss (opt.step(loss=...)), or evaluate in your loop")  # fmt: skip
        _refuse_joined_twice(model)
        config = lane_config(config, rank, world)
        loop = SiteTrainer(model, layout, rank, world, evaluate if rank == 0 else None, **kwargs)
        identity, admission = _identity_of(config, made_here, identity, admission)
    except BaseException:
        site.agree(False, "to prepare its node")
        raise
    site.agree(True, "to prepare its node", identity.peer_id)
    try:
        node, thread, box, ready = _start_node(config, identity, admission, loop)
        _wait_ready(node, thread, ready, box, timeout_s, site.failed_elsewhere)
    except ModelMismatch as exc:
        _default_sigterm()
        site.agree(False, "to join the swarm")
        raise ModelMismatch(
            f"{exc}. This site of {world} ranks exchanges shares named for their layout and "
            f"rank count ('{loop.layout}:{rank}of{world}/...'): every site of a swarm must run "
            "as many ranks with the same layout (DDP or FSDP2), and a site does not mix with "
            "peers of one process") from None  # fmt: skip
    except BaseException:
        _default_sigterm()
        site.agree(False, "to join the swarm")
        raise
    try:
        site.agree(True, "to join the swarm")
        trio.from_thread.run_sync(lambda: site.lead_or_follow(node.algorithm),
                                  trio_token=box["token"])  # fmt: skip
        site.agree_step(loop)
        site.sync(loop, force=True)  # (each rank's share as its lane took it: checkpoint, peer)
    except BaseException:
        _stop_unready(node, box)
        _default_sigterm()
        raise
    loop.start()
    swarm = Swarm(node, loop, thread, box["token"], box)
    swarm._site = site
    _open_swarms.add(swarm)
    return swarm


def _config_of(config: str | Path | NodeConfig | None, overrides: Sequence[str],
               settings: dict[str, Mapping[str, Any]]) -> tuple[NodeConfig, bool]:  # fmt: skip
    """The node config join runs: a file's (or, with none, the one `geotrain local` made for
    this process, or the defaults), with `settings` then `overrides` set over it; and whether
    it was made from no file at all.

    Raises:
        ConfigError: a bad file, setting or override; settings given with a NodeConfig.
    """
    if isinstance(config, NodeConfig):
        if overrides or settings:
            raise ConfigError("settings and overrides go with a config file (or none): with a "
                              "NodeConfig, build it with them (dataclasses.replace)")  # fmt: skip
        return config, False
    if config is None:
        config = launched_config()
        if config is None:
            try:
                return config_from_toml("", base=Path.cwd(), overrides=overrides,
                                        settings=settings), True  # fmt: skip
            except ConfigError as exc:
                raise _no_file(exc) from None
    if not isinstance(config, str | os.PathLike):
        raise ConfigError(f"join({type(config).__name__}, ...): expected a config file's path, "
                          "a NodeConfig, or the model first: geotrain.join(model)")  # fmt: skip
    return load_config(Path(config), overrides, settings), False


def _no_file(exc: ConfigError) -> ConfigError:
    """`exc`, said of a config join made from no file: and how to give it one."""
    return ConfigError(f"{exc}. join() was given no config file and this process was not "
                       "started by `geotrain local`: run it as geotrain local -n 3 -- python "
                       "SCRIPT, or pass a node config file (geotrain node init writes one)")


def _wait_ready(node: Node, thread: threading.Thread, ready: threading.Event,
                box: dict[str, Any], timeout_s: float | None,
                give_up: Callable[[], str | None] | None = None) -> None:  # fmt: skip
    """Wait for a joining node to be ready; one that fails, or is not ready in `timeout_s`, or
    a Ctrl-C meanwhile, raises (the node stopped first); so does a `give_up` that says why
    (polled: another rank of a site failed to join), as a RuntimeError."""
    try:
        if give_up is None:
            in_time = ready.wait(timeout_s)
        else:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not (in_time := ready.wait(0.2)):
                if deadline is not None and time.monotonic() > deadline:
                    break
                why = give_up()
                if why is not None:
                    _stop_unready(node, box)
                    raise RuntimeError(why)
    except BaseException:  # Ctrl-C while waiting: the node stops first, then it goes on
        _stop_unready(node, box)
        raise
    if not in_time:
        doing = node.starting()
        _stop_unready(node, box)
        raise TimeoutError(f"the node was not ready within {timeout_s} s (stopped): "
                           f"it was {doing}")  # fmt: skip
    if "error" in box:
        thread.join(10)
        error = _leaf(box["error"])
        if isinstance(error, Exception) and not isinstance(error, _OUR_BUGS):
            # a refusal the user reads (ModelMismatch, AdmissionRefused, ConfigError, ...): one
            # short traceback from join, not the node thread's nested exception groups
            raise error.with_traceback(None) from None
        raise error from box["error"]


# errors of the node's own code: their traceback inside the node's thread is what tells why
_OUR_BUGS = (AssertionError, AttributeError, NameError, TypeError, IndexError, KeyError)


class MisuseWarning(UserWarning):
    """A way of holding geotrain's API that silently does less than it seems to: an optimizer
    stepped around its wrapper, a scheduler not passed to wrap. The message says what to do.
    (`-W error::geotrain.MisuseWarning` makes each an error.)"""


def _step_hook(optimizer: torch.optim.Optimizer, hook: Callable[..., None]) -> Any:
    """`hook` after each step of `optimizer`, or of the optimizer inside it (Opacus'
    DPOptimizer steps its `original_optimizer`, and has no hooks of its own); None when
    neither takes one."""
    inner = optimizer
    while isinstance(getattr(inner, "original_optimizer", None), torch.optim.Optimizer):
        inner = inner.original_optimizer
    for target in (inner, optimizer):
        with contextlib.suppress(AttributeError, TypeError):
            return target.register_step_post_hook(hook)
    return None


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside torch and geotrain (the user's line)."""
    skip = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
            os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)  # fmt: skip
    frame, level = sys._getframe(1), 1  # (level 1: misuse, which calls warnings.warn)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _refuse_joined_twice(model: torch.nn.Module) -> None:
    """A model whose parameters an open swarm of this process trains already is refused: two
    nodes mixed peers' values into the same tensors from two threads, each checkpointing and
    counting steps of its own, and nothing said so."""
    mine = {id(p) for p in model.parameters()}
    for swarm in list(_open_swarms):  # (a close() in another thread changes the set)
        if swarm._pid == os.getpid() and not swarm._closed and any(
                id(p) in mine for p in swarm._loop.model.parameters()):  # fmt: skip
            raise ValueError(
                f"model {type(model).__name__}: its parameters are already joined to a swarm "
                f"in this process (state dir {str(swarm.node.state.root)!r}): close() that "
                "swarm first; a model trains in one swarm at a time")


def _stop_unready(node: Node, box: dict[str, Any]) -> None:
    """Stop a node that never became ready (its thread may still be starting trio) and wait;
    a Ctrl-C (or a signal handler's SystemExit) meanwhile is raised once it has stopped."""
    interrupted: BaseException | None = None
    while "token" not in box and not box["ended"].is_set():
        try:
            box["ended"].wait(0.01)
        except (KeyboardInterrupt, SystemExit) as exc:
            interrupted = exc
    if "token" in box:
        interrupted = _stop_and_wait(box["token"], node.request_stop, box, 60.0) or interrupted
    if interrupted is not None:
        raise interrupted


def _stop_and_wait(
    token: trio.lowlevel.TrioToken, stop: Callable[[], None], box: dict[str, Any],
    timeout_s: float,
) -> BaseException | None:  # fmt: skip
    """Run `stop` on the node's loop and wait up to `timeout_s` for that loop to end. A Ctrl-C
    meanwhile does not cut the wait short (the interpreter would exit under the node's running
    thread, and nng aborts the process then), nor does a SystemExit a signal handler raises (the
    README's SIGTERM handler, signalled twice): it is returned, to be raised by the caller. (The
    wait is on an event the node's thread sets, not Thread.join: a join cut by Ctrl-C can leave
    is_alive() saying False while the thread runs on.)"""
    interrupted: BaseException | None = None
    while True:
        try:
            trio.from_thread.run_sync(stop, trio_token=token)
            break
        except trio.RunFinishedError:
            break
        except (KeyboardInterrupt, SystemExit) as exc:  # (stop is safe to run twice)
            interrupted = exc
    deadline = time.monotonic() + timeout_s
    while not box["ended"].is_set() and (left := deadline - time.monotonic()) > 0:
        try:
            box["ended"].wait(min(left, 0.1))
        except (KeyboardInterrupt, SystemExit) as exc:
            if interrupted is None:
                structlog.get_logger().warning(
                    "stop_interrupted", detail="the node is stopping (checkpoint, leave): "
                    f"waiting for it, at most {left:.0f} s more")  # fmt: skip
            interrupted = exc
    return interrupted


_open_swarms: set[Swarm] = set()  # (held here: a swarm whose node runs is open whoever holds it)


def _default_sigterm() -> None:
    """Put SIGTERM's default back once no swarm is open (see _signals.exit_on_sigterm)."""
    if not _open_swarms:
        default_sigterm()


@atexit.register
def _close_at_exit() -> None:
    """Close the swarms a program left open (no close(), an exception, the end of a script):
    their nodes checkpoint and leave instead of being cut off mid-flight at exit."""
    for swarm in list(_open_swarms):
        if swarm._pid != os.getpid():  # a forked child's copy: the parent's to close
            continue
        structlog.get_logger().warning(
            "swarm_closed_at_exit", detail="geotrain.join's swarm was not closed: closing it now")
        swarm._site = None  # (at exit the site's other ranks may be gone: no last sync)
        with contextlib.suppress(Exception):
            swarm.close(timeout_s=60.0)


def _loss_value(loss: Any) -> float:
    """`step(loss=...)` as a number (before the step: a bad one takes none).

    Raises:
        ValueError: not one number (a batch of per-sample losses, a string).
    """
    if torch.is_tensor(loss):
        if loss.numel() != 1:
            raise ValueError(f"step(loss=...): a tensor of {loss.numel()} values; give the one "
                             "loss of the step (e.g. loss.mean())")  # fmt: skip
        return float(loss.detach())
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):  # (numpy's too)
        raise ValueError(f"step(loss={loss!r:.40}): expected a number or a one-value tensor")
    return float(loss)


def _leaf(error: BaseException) -> BaseException:
    """The one real error inside trio's exception groups."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
