"""The channel runtime: collectives a model calls through handles the plan declares.

A model never calls ``torch.distributed`` directly for a declared channel; it calls
``channels["tp_ar"].all_reduce(x)``. The handle decides, from the pipeline's events and
the channel's warmup policy, how that call is served (``graphflow.dist.trace.CallPath``):

===================  =================================================================
phase                what the collective does
===================  =================================================================
warmup               ``real``: the real collective. ``prepare``: the channel's prepare
                     hook, once per specialization, then a zero-filled output; no
                     communication. ``placeholder``: a zero-filled output; no
                     communication (never uninitialized memory, so ranks stay equal).
prewarm              nothing may communicate: a collective here is a CaptureError.
capture              inside a region: the real collective (captured, on CUDA). Outside
                     a region (an eager warmup run inside the capture phase): as warmup.
verify, after        the real collective.
===================  =================================================================

With world size 1 and no process group the real collective is the identity
(all_gather and all_to_all copy their input). ``p2p`` needs a peer, so it needs a
process group.

Lifecycle of a ``ChannelRuntime`` (it is a ``graphflow.events.Listener``):

1. construction (cheap): one handle per channel of the selected families, each with its
   own scratch buffers; groups are bound through ``group_factory`` (the world group by
   default, for every group name).
2. ``PIPELINE_BEGIN``: the channel ids are taken in the ``ChannelRegistry`` (an id owned
   by another family's live handle is a CaptureError); their release is deferred on the
   pipeline's rollback stack, so a failed capture gives them back.
3. every phase and descriptor boundary: one trace event, then a store barrier
   (``graphflow.dist.barrier``) that compares the ranks' running trace hashes; a collective
   in warmup or capture first agrees on its call through the store, so no rank enters
   a collective the others will not. A disagreement or a timeout is a DivergenceError
   on every rank that can still reach the store.
   ``SEGMENT_BEGIN/END`` only name the running segment for the trace: no trace event,
   no barrier.
4. ``ROLLBACK`` (or an event carrying an error): the other ranks are told at once: an
   "abandoned" arrival on every barrier the rank agrees in, and one record for the
   pipeline that a collective outside the agreeing phases (verify) checks before it
   communicates. A rank that a barrier gave up on raises at its next barrier
   (``graphflow.dist.barrier``). Either way no rank enters a collective another rank has
   left, so the process group stays usable for the next pipeline.
5. ``PIPELINE_END``: committed; the hot path is a plain collective (plus a trace event
   if tracing).
6. ``close()``: handles (communicators) closed, ids released, owned process groups
   destroyed, no process group held any longer (by the runtime or by a handle a model
   keeps), trace closed: every step runs even when an earlier one raises, and the
   failures are raised together as one ExceptionGroup.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from graphflow.dist.barrier import DEFAULT_TIMEOUT_S, StoreBarrier
from graphflow.engine.model.binding import resolve
from graphflow.engine.locus import Where
from graphflow.engine.rollback import UndoStack
from graphflow.errors import CaptureError, DivergenceError
from graphflow.events import Event, EventKind, Phase
from graphflow.plan import Channel, ChannelKind, Mode, Plan, WarmupPolicy
from graphflow.dist.trace import CallPath, TraceLog, Tracer

__all__ = [
    "ChannelHandle",
    "ChannelRegistry",
    "ChannelRuntime",
    "GroupBinding",
    "Scope",
    "new_group_factory",
    "world_group_factory",
]

#: Phases in which a collective first agrees on its call through the store: where
#: ranks can take different paths (warmup values, capture) and a mismatch would hang.
AGREE_PHASES = frozenset({Phase.WARMUP, Phase.CAPTURE})

_WORLD = "world"


@attrs.frozen
class GroupBinding:
    """A channel group bound to a process group.

    ``group`` is None only at world size 1 without ``torch.distributed``. ``destroy``
    is set when the factory created the group for this runtime, which then destroys
    it at close (after the handles that use it).
    """

    name: str
    group: Any
    members: tuple[int, ...] = attrs.field(converter=tuple)
    destroy: Callable[[], None] | None = attrs.field(default=None, eq=False)

    def released(self) -> GroupBinding:
        """The same binding holding no process group: what a closed runtime keeps."""
        return attrs.evolve(self, group=None, destroy=None)


def world_group_factory(world_size: int) -> Callable[[str], GroupBinding]:
    """The default: every group name is bound to the world group (owned by the caller)."""

    def bind(name: str) -> GroupBinding:
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        return GroupBinding(name, group, tuple(range(world_size)))

    return bind


def new_group_factory(rank: int, layout: Mapping[str, Sequence[Sequence[int]]], *,
                      timeout_s: float = 2 * DEFAULT_TIMEOUT_S) -> Callable[[str], GroupBinding]:
    """Process groups made for the runtime: ``layout`` partitions the ranks per group name.

    ``{"tp": [[0, 1], [2, 3]]}`` gives ranks 0 and 1 one ``tp`` group and ranks 2 and 3
    another. Every rank creates every partition's group, in order (``new_group`` is
    collective), and is bound to the one it belongs to. Each group gets its own
    ``timeout_s``: the backstop behind the store barrier. The runtime destroys these
    groups at close, after the handles that use them. A name not in ``layout`` is
    bound to the world group.
    """
    world = world_group_factory(dist.get_world_size() if dist.is_initialized() else 1)

    def bind(name: str) -> GroupBinding:
        partitions = layout.get(name)
        if partitions is None:
            return world(name)
        mine = None
        for ranks in partitions:
            group = dist.new_group(sorted(ranks), timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks:
                mine = GroupBinding(name, group, tuple(sorted(ranks)),
                                    destroy=functools.partial(dist.destroy_process_group, group))
        if mine is None:
            raise CaptureError(f"rank {rank} is in no partition of group {name!r}: {list(map(list, partitions))}",
                               rank=rank, hint="list every rank in exactly one partition of each group")
        return mine

    return bind


class ChannelRegistry:
    """Which (family, id) owns which semantic channel id, across pipelines of a process.

    A target and a draft family run separate pipelines but share the registry, so the
    draft cannot take the target's id, and a failed draft capture gives back only its
    own ids.
    """

    def __init__(self):
        self._owners: dict[int, ChannelHandle] = {}

    def owner(self, channel_id: int) -> ChannelHandle | None:
        return self._owners.get(channel_id)

    @property
    def taken(self) -> dict[int, str]:
        """Each taken id's owner, as ``family/channel``."""
        return {i: f"{h.channel.family}/{h.channel.name}" for i, h in sorted(self._owners.items())}

    def take(self, handles: Iterable[ChannelHandle]) -> Callable[[], None]:
        """Take every handle's id, all or none; returns the function that gives them back."""
        handles = list(handles)
        for handle in handles:
            owner = self._owners.get(handle.channel.id)
            if owner is not None and owner is not handle:
                raise CaptureError(
                    f"channel id {handle.channel.id} of {handle.channel.family}/{handle.channel.name} is "
                    f"already owned by {owner.channel.family}/{owner.channel.name}",
                    hint="give each family's channels their own semantic ids",
                )
        for handle in handles:
            self._owners[handle.channel.id] = handle
        self.check_isolation()

        def release() -> None:
            for handle in handles:
                if self._owners.get(handle.channel.id) is handle:
                    del self._owners[handle.channel.id]

        return release

    def check_isolation(self) -> None:
        """No two families' live handles share a handle object or a scratch buffer."""
        seen_handles: dict[int, ChannelHandle] = {}
        seen_storage: dict[int, ChannelHandle] = {}
        for handle in self._owners.values():
            other = seen_handles.setdefault(id(handle), handle)
            if other is not handle:
                raise CaptureError(f"channel handle shared by {other.channel.name} and {handle.channel.name}")
            for ptr in handle.storage_ptrs():
                other = seen_storage.setdefault(ptr, handle)
                if other is not handle:
                    raise CaptureError(
                        f"channels {other.channel.family}/{other.channel.name} and "
                        f"{handle.channel.family}/{handle.channel.name} share a scratch buffer",
                        hint="each (family, id) must own its buffers; do not pass one channel's output "
                             "as another's 'out'",
                    )


@attrs.frozen
class Scope:
    """The ranks that must agree on a channel's calls: a group's members.

    Groups with the same members share one scope (and one barrier sequence), so a rank
    calling a collective on one while another rank calls on the other, or reaches a
    phase boundary, is a disagreement at once, not a timeout. ``key`` names it in the
    trace log and the barrier namespace.
    """

    members: tuple[int, ...] = attrs.field(converter=lambda m: tuple(sorted(m)))
    world: bool = False

    @property
    def key(self) -> str:
        return _WORLD if self.world else "ranks:" + "-".join(map(str, self.members))


#: Where a runtime is when no pipeline runs.
_NOWHERE = Where()


class ChannelHandle:
    """One channel of one family: its group, its scratch buffers, its warmup policy.

    The hot path (after commit, tracing off) is one attribute check and the collective.
    """

    def __init__(self, runtime: ChannelRuntime, channel: Channel, binding: GroupBinding):
        self.channel = channel
        self.binding = binding
        self._runtime = runtime
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._prepare: Callable[[torch.Tensor], Any] | None = None
        self._prepared: set[tuple] = set()
        self._closed = False
        self.scope = runtime.scope_for(binding)  # the ranks that must agree on this channel's calls
        for kind, methods in _METHODS.items():  # refused once here, so the hot path checks nothing
            if kind is not channel.kind:
                for method in methods:
                    setattr(self, method, functools.partial(self._wrong_kind, kind))

    def __repr__(self) -> str:
        c = self.channel
        return f"ChannelHandle({c.family}/{c.name}, id={c.id}, {c.kind.value}, group={c.group}, warmup={c.warmup.value})"

    # -- public API: the collectives ------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        if self._runtime.fast:
            self._real_all_reduce(tensor)
            return tensor
        return self._call(ChannelKind.ALL_REDUCE, tensor, None, None)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every member's ``tensor`` along dim 0 into ``out`` (or a scratch buffer)."""
        out = out if out is not None else self.scratch((len(self.binding.members) * tensor.shape[0], *tensor.shape[1:]),
                                                       tensor.dtype, tensor.device)
        if self._runtime.fast:
            self._real_all_gather(tensor, out)
            return out
        return self._call(ChannelKind.ALL_GATHER, tensor, out, None)

    def all_to_all(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Scatter equal dim-0 chunks of ``tensor`` to the members; gather theirs into ``out``."""
        out = out if out is not None else self.scratch(tuple(tensor.shape), tensor.dtype, tensor.device)
        if self._runtime.fast:
            self._real_all_to_all(tensor, out)
            return out
        return self._call(ChannelKind.ALL_TO_ALL, tensor, out, None)

    def send(self, tensor: torch.Tensor, dst: int) -> torch.Tensor:
        """Send ``tensor`` to rank ``dst`` (a p2p channel)."""
        return self._call(ChannelKind.P2P, tensor, None, ("send", dst))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` from rank ``src`` (a p2p channel)."""
        return self._call(ChannelKind.P2P, tensor, None, ("recv", src))

    def set_prepare(self, hook: Callable[[torch.Tensor], Any]) -> None:
        """The ``prepare`` warmup hook, called with the input tensor once per (shape, dtype,
        device): compiles that specialization, never communicates."""
        self._prepare = hook

    def path(self) -> CallPath:
        """How a call made now would be served."""
        return self._runtime.path_for(self.channel)

    # -- buffers -------------------------------------------------------------------------
    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This handle's own output buffer for a shape, allocated once (during warmup)."""
        key = (tuple(shape), dtype, torch.device(device))
        buffer = self._scratch.get(key)
        if buffer is None:
            buffer = self._scratch[key] = torch.zeros(shape, dtype=dtype, device=device)
        return buffer

    def storage_ptrs(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self._scratch.values() if t.numel()}

    def close(self) -> None:
        """Release this handle's buffers and its process group; later calls raise.

        A model may keep its handles after the session (a class attribute, a cycle only
        the garbage collector frees): a process group they held would outlive
        ``destroy_process_group``, and a gloo group still alive as the interpreter
        finalizes aborts the process ("terminate called without an active exception")."""
        self._closed = True
        self._scratch.clear()
        self._prepared.clear()
        self.binding = self.binding.released()

    # -- the slow path: trace, agree, then serve by path ----------------------------------
    def _call(self, kind: ChannelKind, tensor: torch.Tensor, out: torch.Tensor | None, p2p) -> torch.Tensor:
        runtime = self._runtime
        if self._closed:
            raise CaptureError(f"channel {self.channel.name} is closed")
        path = runtime.path_for(self.channel)
        if runtime.recording:
            capturing = bool(tensor.is_cuda and torch.cuda.is_current_stream_capturing())
            event = runtime.record_call(self, kind, tensor, path, capturing, p2p)
            if runtime.agreeing:
                runtime.agree(self.scope, f"{kind.value} {self.channel.name} {list(tensor.shape)} "
                                           f"{str(tensor.dtype).removeprefix('torch.')}", event)
            elif runtime.active and path not in (CallPath.PREPARE, CallPath.PLACEHOLDER):
                runtime.check_abandoned(self.scope, f"{event['op']} on {self.channel.name}", event)
        result = tensor if out is None else out
        if path is CallPath.PREPARE:
            self._run_prepare(tensor)
        if path in (CallPath.PREPARE, CallPath.PLACEHOLDER):
            if p2p is None or p2p[0] == "recv":
                result.zero_()
            return result
        if kind is ChannelKind.ALL_REDUCE:
            self._real_all_reduce(tensor)
        elif kind is ChannelKind.ALL_GATHER:
            self._real_all_gather(tensor, out)
        elif kind is ChannelKind.ALL_TO_ALL:
            self._real_all_to_all(tensor, out)
        else:
            self._real_p2p(tensor, *p2p)
        return result

    def _wrong_kind(self, kind: ChannelKind, *args, **kwargs):
        raise CaptureError(
            f"channel {self.channel.name} is {self.channel.kind.value}, called as {kind.value}",
            hint=f"call the handle's {self.channel.kind.value} method, or declare a {kind.value} channel",
        )

    def _run_prepare(self, tensor: torch.Tensor) -> None:
        key = (tuple(tensor.shape), tensor.dtype, tensor.device)
        if key in self._prepared:
            return
        hook = self._prepare or self._runtime.resolve_prepare(self.channel)
        hook(tensor)
        self._prepared.add(key)

    def _real_all_reduce(self, tensor: torch.Tensor) -> None:
        if self.binding.group is not None:
            dist.all_reduce(tensor, group=self.binding.group)

    def _real_all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        if self.binding.group is None:
            out.copy_(tensor)
        else:
            _all_gather_into(out, tensor, group=self.binding.group)

    def _real_all_to_all(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        if self.binding.group is None:
            out.copy_(tensor)
        else:
            dist.all_to_all_single(out, tensor, group=self.binding.group)

    def _real_p2p(self, tensor: torch.Tensor, op: str, peer: int) -> None:
        if self.binding.group is None:
            raise CaptureError(f"p2p channel {self.channel.name} needs a process group (world size > 1)")
        if op == "send":
            dist.send(tensor, peer, group=self.binding.group)
        else:
            dist.recv(tensor, peer, group=self.binding.group)


#: ``all_gather_single`` replaces ``all_gather_into_tensor`` in newer torch.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ChannelRuntime:
    """The channels of one pipeline run (a Listener): handles, ids, barriers and trace.

    ``families`` selects whose channels this runtime owns (all by default): run the
    target and the draft as two pipelines with two runtimes sharing one ``registry``.
    ``store`` is the c10d store the barriers use (the default process group's store
    when ``torch.distributed`` is initialized). ``tracer`` writes the per-rank trace
    (None: ``Tracer.from_env``; False: off whatever the environment says).
    ``agree_phases`` are the phases in which each collective agrees on its call
    through the store first. ``timeout_s`` defaults to the plan's
    ``capture.barrier_timeout_s``.
    """

    #: The engine's locus names the running segment: no event per segment call needed.
    segment_events = False

    def __init__(self, plan: Plan, *, rank: int = 0, world_size: int = 1, families: Iterable[str] | None = None,
                 group_factory: Callable[[str], GroupBinding] | None = None, registry: ChannelRegistry | None = None,
                 store=None, tracer: Tracer | None | bool = None, timeout_s: float | None = None,
                 agree_phases: Iterable[Phase] = AGREE_PHASES, namespace: str | None = None):
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.families = tuple(sorted(set(families) if families is not None else {f.name for f in plan.families}))
        self.registry = registry if registry is not None else ChannelRegistry()
        self.timeout_s = timeout_s if timeout_s is not None else plan.capture.barrier_timeout_s or DEFAULT_TIMEOUT_S
        self.agree_phases = frozenset(agree_phases)
        self.namespace = namespace or f"graphflow/{plan.name}/{'+'.join(self.families)}"
        if tracer is None:
            tracer = Tracer.from_env(rank)
        self.tracer: Tracer | None = tracer or None
        self.log = TraceLog(rank, self.tracer)
        self._store = store
        self._locus = None  # the running pipeline's (``Event.locus``); None between pipelines
        self._failed = False
        self._pipelines = 0
        self._barriers: dict[str, StoreBarrier] = {}
        self._release_ids: Callable[[], None] | None = None
        self._model = None
        #: True while calls go straight to the collective: no pipeline running, tracing off.
        self.fast = self.tracer is None
        factory = group_factory or world_group_factory(world_size)
        self._bindings: dict[str, GroupBinding] = {}
        self.handles: dict[str, ChannelHandle] = {}
        self._users = {c.name: tuple(s.name for s in plan.segments if c.name in s.channels) for c in plan.channels}
        self._regions = {(m, r.name): r.segments for m in plan.capture.modes for r in plan.regions(m)}
        self._world = Scope(range(world_size), world=True)
        for channel in plan.channels:
            if channel.family not in self.families:
                continue
            binding = self._bindings.get(channel.group)
            if binding is None:
                binding = self._bindings[channel.group] = factory(channel.group)
            if rank in binding.members:
                self.handles[channel.name] = ChannelHandle(self, channel, binding)

    def __repr__(self) -> str:
        return f"ChannelRuntime({self.plan.name!r}, rank={self.rank}, families={list(self.families)})"

    # -- what handles ask -------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether a pipeline is running (between its PIPELINE_BEGIN and END or ROLLBACK)."""
        return self._locus is not None

    @property
    def recording(self) -> bool:
        return self.active or self.tracer is not None

    @property
    def agreeing(self) -> bool:
        return self.active and self._locus.here.phase in self.agree_phases

    def scope_for(self, binding: GroupBinding) -> Scope:
        """The agreement scope of a group: ranks agree within the set of ranks that communicate."""
        if set(binding.members) == set(range(self.world_size)):
            return Scope(binding.members, world=True)
        return Scope(binding.members)

    @property
    def site(self) -> Where:
        """Where the running pipeline is (the engine's own locus); nowhere between pipelines."""
        return self._locus.here if self._locus is not None else _NOWHERE

    def path_for(self, channel: Channel) -> CallPath:
        site = self.site
        if not self.active or site.phase in (None, Phase.ALLOCATE, Phase.VERIFY, Phase.COMMIT, Phase.ROLLBACK):
            return CallPath.OUTSIDE_CAPTURE
        if site.phase is Phase.PREWARM:
            raise CaptureError(
                f"channel {channel.name} was called during prewarm", phase=Phase.PREWARM.value, rank=self.rank,
                descriptor=site.descriptor,
                hint="prewarm hooks compile specializations and must not communicate; use the channel's "
                     "warmup policy 'prepare' instead",
            )
        if site.phase is Phase.CAPTURE and site.region is not None:
            return CallPath.CAPTURED
        return _WARMUP_PATH[channel.warmup]

    def bind(self, model) -> None:
        """Resolve ``prepare`` hooks named by ``Channel.prewarm`` on this model.

        A name in the plan's ``prewarm`` list is called as that hook is declared (with
        the descriptor's size when ``per_size``, else with nothing); any other name is
        a call path on the model, called with the input tensor.
        """
        self._model = model

    def resolve_prepare(self, channel: Channel) -> Callable[[torch.Tensor], Any]:
        if channel.prewarm is None or self._model is None:
            raise CaptureError(
                f"channel {channel.name} has warmup 'prepare' but no prepare hook",
                phase=Phase.WARMUP.value, rank=self.rank,
                hint="declare 'prewarm: HOOK' on the channel and bind the model (ChannelRuntime.bind), or call "
                     "handle.set_prepare(fn) from the model",
            )
        hook = self.plan.hook(channel.prewarm)
        if hook is None:  # the name is itself a call path on the model, given the input
            return resolve(self._model, channel.prewarm, kind="channel", name=channel.name, plan=self.plan)
        fn = resolve(self._model, hook.call, kind="prewarm", name=hook.name, plan=self.plan)
        if not hook.per_size:
            return lambda tensor: fn()
        # A plan hook keeps its declared convention: called with the descriptor's batch size.
        return lambda tensor: fn(getattr(self.site.descriptor, "size", tensor.shape[0]))

    def segment_for(self, channel: Channel) -> str | None:
        """The running segment, as the engine's locus names it. Where the engine runs no
        segment block (a region replayed as one call), the plan's answer: the only segment
        (of the current region, if any) that uses this channel; None when several could."""
        site = self.site
        if site.segment is not None:
            return site.segment
        users = self._users.get(channel.name, ())
        region = self._region_segments(site)
        if region:
            users = tuple(s for s in users if s in region)
        return users[0] if len(users) == 1 else None

    def record_call(self, handle: ChannelHandle, kind: ChannelKind, tensor: torch.Tensor, path: CallPath,
                    capturing: bool, p2p) -> dict:
        site, channel = self.site, handle.channel
        fields = {
            "event": "collective", "op": kind.value if p2p is None else p2p[0],
            "phase": site.phase.value if site.phase else None, "descriptor": _text(site.descriptor),
            "region": site.region, "segment": self.segment_for(channel), "channel": channel.name,
            "family": channel.family, "channel_id": channel.id, "group": channel.group,
            "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "bytes": tensor.numel() * tensor.element_size(), "path": path.value, "capturing": capturing,
        }
        if p2p is not None:
            fields["peer"] = p2p[1]
        # Hashes matter only in a pipeline.
        return self.log.record(fields, (handle.scope.key,) if self.active else ())

    def agree(self, scope: Scope, label: str, event: dict) -> None:
        site = self.site
        self._barrier(scope).arrive(label, self.log.state(scope.key), phase=_value(site.phase),
                                    descriptor=site.descriptor, segment=event.get("segment"))

    def check_abandoned(self, scope: Scope, call: str, event: dict) -> None:
        """Before a collective that agrees on nothing (verify): raise if a rank has already
        abandoned this pipeline, instead of entering a collective it will never join."""
        if len(scope.members) == 1:
            return
        store = self._resolve_store(len(scope.members))
        key = self._abandoned_key()
        if not store.check([key]):
            return
        record = json.loads(store.get(key))
        site = self.site
        raise DivergenceError(
            f"rank {record['rank']} abandoned the pipeline ({record['reason']}): rank {self.rank} does not enter "
            f"its {call}, which rank {record['rank']} would never join",
            ranks=(record["rank"],), rank=self.rank, phase=_value(site.phase), descriptor=site.descriptor,
            segment=event.get("segment"),
            hint=f"see rank {record['rank']}'s error for the cause",
        )

    def _abandoned_key(self) -> str:
        return f"{self.namespace}/{self._pipelines}/abandoned"

    # -- the listener ------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        kind = event.kind
        if kind is EventKind.SEGMENT_BEGIN or kind is EventKind.SEGMENT_END:
            return  # the locus names the running segment: no trace event, no barrier per call
        if kind is EventKind.PIPELINE_BEGIN:
            self._begin(event)
        if not self.active:
            return
        record = self.log.record({"event": kind.value, "phase": _value(event.phase),
                                  "descriptor": _text(event.descriptor), "region": event.region})
        if kind is EventKind.PHASE_END and event.phase in (Phase.WARMUP, Phase.CAPTURE):
            self.registry.check_isolation()
        if event.error is not None or kind is EventKind.ROLLBACK:
            self._abandon(event.error or "rolled back")
        elif kind not in (EventKind.REGION_BEGIN, EventKind.REGION_END):
            if self.tracer is not None:  # on disk before waiting: a rank killed in a hang leaves its trace
                self.tracer.flush()
            self._barrier(self._world).arrive(f"{kind.value} {record['phase']} {record['descriptor']}",
                                              self.log.state(_WORLD), phase=record["phase"],
                                              descriptor=event.descriptor)
        if kind in (EventKind.PIPELINE_END, EventKind.ROLLBACK):
            self._end()

    def _begin(self, event: Event) -> None:
        self._pipelines += 1
        self._locus = event.locus
        self._failed = False
        self._barriers = {}
        self.fast = False
        self._release_ids = self.registry.take(self.handles.values())
        if event.defer is not None:
            event.defer("release channel ids", self._rollback_ids)

    def _rollback_ids(self) -> None:
        if self._release_ids is not None:
            self._release_ids()
            self._release_ids = None

    def _end(self) -> None:
        self._locus = None
        self.fast = self.tracer is None
        if self.tracer is not None:
            self.tracer.flush()

    def _abandon(self, reason: str) -> None:
        """Tell every scope this rank agrees in, used yet or not, that it will not arrive again."""
        if self._failed:
            return
        self._failed = True
        if self.world_size > 1:  # the record a collective checks where no barrier agrees first
            self._resolve_store(self.world_size).compare_set(
                self._abandoned_key(), "", json.dumps({"rank": self.rank, "reason": reason}))
        for scope in dict.fromkeys((self._world, *(h.scope for h in self.handles.values()))):
            self._barrier(scope).abandon(reason, self.log.state(scope.key))
        if self.tracer is not None:
            self.tracer.flush()

    def _barrier(self, scope: Scope) -> StoreBarrier:
        barrier = self._barriers.get(scope)
        if barrier is None:
            barrier = self._barriers[scope] = StoreBarrier(
                self._resolve_store(len(scope.members)), self.rank, scope.members, timeout_s=self.timeout_s,
                namespace=f"{self.namespace}/{self._pipelines}/{scope.key}")
        return barrier

    def _resolve_store(self, members: int):
        if self._store is None and members > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise CaptureError("the phase barrier needs a c10d store: pass store= or initialize "
                                   "torch.distributed", rank=self.rank)
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def _region_segments(self, site: Where) -> tuple[str, ...]:
        if site.region is None:
            return ()
        mode = getattr(site.descriptor, "mode", None)
        for m in (mode,) if isinstance(mode, Mode) else tuple(Mode):
            found = self._regions.get((m, site.region))
            if found is not None:
                return found
        return ()

    # -- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Close handles, then release ids, then destroy owned groups and let go of every
        group, then the trace.

        Every step runs; the failures are raised together (``UndoError``, each noted
        with the step that raised it).
        """
        steps = UndoStack()  # last in, first out: pushed in the reverse of the order they run
        if self.tracer is not None:
            steps.push("close trace", self.tracer.close)
        steps.push("let go of the process groups", self._release_groups)
        for binding in reversed(self._bindings.values()):
            if binding.destroy:
                steps.push(f"destroy group {binding.name}", binding.destroy)
        steps.push("release channel ids", self._rollback_ids)
        for name, handle in reversed(self.handles.items()):
            steps.push(f"close channel {name}", handle.close)
        count = len(steps)
        failures = steps.unwind()
        self.fast = False  # closed handles take the slow path, which refuses the call
        if failures is not None:
            raise type(failures)(f"channel teardown: {len(failures.exceptions)} of {count} steps failed",
                                 failures.exceptions)

    def _release_groups(self) -> None:
        """Hold no process group once closed (``ChannelHandle.close`` says why): whoever
        destroys one then frees it, its threads joined, while the interpreter is whole."""
        self._bindings = {name: binding.released() for name, binding in self._bindings.items()}


_METHODS = {
    ChannelKind.ALL_REDUCE: ("all_reduce",),
    ChannelKind.ALL_GATHER: ("all_gather",),
    ChannelKind.ALL_TO_ALL: ("all_to_all",),
    ChannelKind.P2P: ("send", "recv"),
}

_WARMUP_PATH = {
    WarmupPolicy.REAL: CallPath.EAGER_WARMUP,
    WarmupPolicy.PREPARE: CallPath.PREPARE,
    WarmupPolicy.PLACEHOLDER: CallPath.PLACEHOLDER,
}


def _value(phase: Phase | None) -> str | None:
    return phase.value if phase is not None else None


def _text(descriptor) -> str | None:
    return None if descriptor is None else str(descriptor)
