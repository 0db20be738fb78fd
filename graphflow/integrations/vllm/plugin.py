"""The vLLM plugin: validate before capture, capture as a transaction, trace and agree.

vLLM loads every ``vllm.general_plugins`` entry point in each process that runs a model
(the engine core and every worker), before the worker class exists; ``register`` is that
entry point (plain ``pip install graphflow`` installs it, into a vLLM fork too). It
does nothing unless ``GRAPHFLOW_VLLM`` is on; when on, it also adds ``GRAPHFLOW_`` to the
prefixes vLLM copies to the Ray actors it starts (``settings.carry_to_ray_workers``). It
never stops vLLM from starting: a setting it cannot read, a vLLM other than 0.33.x (unless ``GRAPHFLOW_VLLM_ANY_VERSION`` is on) and
a vLLM attribute it cannot wrap each log one line and leave the plugin off. Otherwise,
once per process, it wraps vLLM's capture paths (``graphflow.integrations.vllm.hooks``)
and in each capture or profiling run:

1. builds the plan from the runner's resolved descriptors and its post-init config
   (``plan_from_engine``), runs graphflow's rules, logs every finding with its code and
   refuses to capture (``CaptureError``, phase ``validate``, logged) on an error: every rank has
   the same config, so every rank refuses alike;
2. opens a ``CaptureSession`` among the engine's own ranks (``group.py``: with data
   parallelism vLLM's world spans every engine, which must not wait for each other):
   the ranks first compare their settings, then cross a store barrier at each phase
   boundary per descriptor; every custom all-reduce traced and served by its family's
   warmup policy;
3. runs vLLM's capture inside a ``CaptureTransaction``; on any failure it tells the
   other ranks at once (``abandon``), rolls back, logs the failure and raises
   ``CaptureError`` naming the mode, descriptor and rank, or, with
   ``GRAPHFLOW_VLLM_ON_FAILURE=eager``, logs it and serves eagerly. A trace file that cannot be written is no such failure:
   the ``Tracer`` warns once and marks the trace incomplete, and the graphs stand;
4. logs what it captured, how long it took and the memory vLLM reports (and that the
   trace is incomplete, when it is).

``unregister()`` puts every wrapped attribute back. Settings: ``settings.py``; the log,
through vLLM's: ``logs.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from graphflow.errors import CaptureError, DivergenceError, PlanError
from graphflow.integrations.vllm.descriptors import VllmDescriptor, VllmPlan
from graphflow.integrations.vllm.group import EngineGroup, engine_group
from graphflow.integrations.vllm.session import CaptureSession
from graphflow.integrations.vllm.logs import forget_startup, log, release, startup
from graphflow.integrations.vllm.settings import ANY_VERSION_ENV, PREFIX, RAY_PREFIXES_ENV, PluginSettings, \
    SettingsError, carry_to_ray_workers
from graphflow.dist.trace import TraceLog, Tracer
from graphflow.plan.rules import Severity, validate

__all__ = ["SUPPORTED_VLLM", "Plugin", "register", "registered", "unregister"]

#: The vLLM release series the hooks were written and tested against: they wrap its
#: internals, which move between releases.
SUPPORTED_VLLM = "0.33"

#: Findings logged per rule code before the rest are counted in one line.
_SHOWN_PER_CODE = 5

_PLUGIN: Plugin | None = None

#: Capture sessions opened in this process, the generation in each store namespace: every
#: rank of an engine opens them in the same order (an engine restarted is new processes,
#: counting from 1 together), and a namespace is never reused, even by a plugin
#: registered again.
_SESSIONS = itertools.count(1)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the plugin if ``GRAPHFLOW_VLLM`` is on.

    Never raises for a bad setting, another vLLM version or a hook it cannot install: vLLM
    calls it unguarded in every process, so raising would stop the engine; each logs one
    line instead and the plugin stays off, having changed nothing (not even the Ray
    variable, which only a plugin that is on needs). Idempotent per process: a second call
    (vLLM calls it in the engine core and again in each worker it forks) changes nothing.
    Its lines are start-up lines (``logs.startup``): vLLM loads general plugins before it
    sets its logging up, so they are logged with vLLM's first lines, once per process.
    """
    global _PLUGIN
    if _PLUGIN is not None:
        return
    try:
        settings = PluginSettings.from_env()
    except SettingsError as error:
        startup(logging.ERROR, "%s; plugin off", error)
        return
    if not settings.enabled:
        return
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if not _supported(version):
        if not settings.any_version:
            startup(logging.WARNING, "vLLM %s is not %s.x, the version this plugin wraps: plugin off (%s=1 tries "
                    "anyway)", version, SUPPORTED_VLLM, ANY_VERSION_ENV)
            return
        startup(logging.WARNING, "vLLM %s is not %s.x, the version this plugin wraps: trying anyway (%s)",
                version, SUPPORTED_VLLM, ANY_VERSION_ENV)
    plugin = Plugin(settings)
    try:
        plugin.install()
    except Exception as error:  # an attribute another vLLM moved: vLLM runs on without the plugin
        plugin.uninstall()
        startup(logging.ERROR, "cannot wrap vLLM %s (%s: %s): plugin off", version, type(error).__name__, error)
        return
    _PLUGIN = plugin
    if carry_to_ray_workers():  # the processes this one starts inherit the variable: logged here only
        startup(logging.INFO, "added %s to %s: the Ray actors vLLM starts from this process get the plugin's "
                "settings", PREFIX, RAY_PREFIXES_ENV, every_process=False)
    startup(logging.INFO, "vLLM plugin enabled on vLLM %s (warmup %s, on failure %s, barrier timeout %g s%s)",
            version, _policies(settings), settings.on_failure, settings.timeout_s,
            f", trace in {settings.trace_dir}" if settings.trace_dir else "")


def unregister() -> None:
    """Undo ``register``: every wrapped vLLM attribute back as it was, its trace closed,
    and its start-up lines not logged yet dropped."""
    global _PLUGIN
    forget_startup()
    if _PLUGIN is not None:
        _PLUGIN.uninstall()
        _PLUGIN = None


def registered() -> Plugin | None:
    """The installed plugin of this process, or None."""
    return _PLUGIN


def _supported(version: str) -> bool:
    return version == SUPPORTED_VLLM or version.startswith(f"{SUPPORTED_VLLM}.")


def _policies(settings: PluginSettings) -> str:
    named = ", ".join(f"{f}={p.value}" for f, p in settings.warmup.items())
    return named or "placeholder (vLLM's)"


class Plugin:
    """The plugin's state in one process: settings, patches, the trace, the open session."""

    def __init__(self, settings: PluginSettings):
        from graphflow.integrations.vllm.hooks import Patches

        self.settings = settings
        self.patches = Patches()
        self.session: CaptureSession | None = None
        self.plans: list[VllmPlan] = []
        self._log: TraceLog | None = None
        self._trace_pid: int | None = None  # the process that opened the trace
        self._validated = False
        self._prepared: set[tuple] = set()
        self._failed_at: tuple | None = None
        #: V2: the id of the runner's own graph manager (the target); the speculator's are drafters.
        self.target_managers: set[int] = set()

    def install(self) -> None:
        from graphflow.integrations.vllm.hooks import install_hooks

        install_hooks(self.patches, self)

    def uninstall(self) -> None:
        self.patches.undo()
        self.close_trace()
        atexit.unregister(self.close_trace)

    def close_trace(self) -> None:
        """Close this process's trace file, ending one that lost events with its
        ``trace_incomplete`` record. Under vLLM nothing unregisters the plugin, so this runs
        when vLLM shuts its worker down (the engine ends; a forked worker then leaves
        through ``os._exit``, which runs no exit handler) and at interpreter exit (a
        spawned worker, a script). Closing twice is harmless, and a trace closed before a
        later capture reopens for it. A forked child's copy of its parent's file is left
        alone: closing it would write the parent's buffered events twice."""
        if self._log is not None and self._log.sink is not None and self._trace_pid == os.getpid():
            self._log.sink.close()

    def active(self) -> Plugin | None:
        """Self while a session is open (the hooks' test), else None."""
        return self if self.session is not None else None

    # -- one capture or profiling run ----------------------------------------------------
    def run_capture(self, runner: Any, capture: Callable[[], Any], *, profile: bool) -> Any:
        if self.session is not None:  # V2's profiling calls capture_model inside its own run
            return capture()
        release()  # start-up lines still held (vLLM has not logged since its set-up) come before the capture's
        import torch.distributed as dist

        from graphflow.integrations.vllm.engine import plan_from_engine, runner_kind
        from graphflow.integrations.vllm.hooks import runner_hooks, transaction_for

        rank = dist.get_rank() if dist.is_initialized() else 0
        if hasattr(runner, "_maybe_init_encoder_cudagraph_manager") and not profile:
            runner._maybe_init_encoder_cudagraph_manager()  # V1 makes it at capture start; read its budgets
        try:
            plan = plan_from_engine(runner, warmup=self.settings.warmup, data_dependent=self.settings.routed,
                                    barrier_timeout_s=self.settings.timeout_s)
        except PlanError as error:
            raise _logged(CaptureError(f"graphflow refused to capture: {error}", phase="validate", rank=rank,
                                       hint="fix the vLLM setting it names")) from error
        if not plan.descriptors:
            return capture()
        self.plans.append(plan)
        if not self._validated:
            self._validate(plan, rank)
            self._validated = True
        what = "profiling" if profile else "capture"
        session = self._open(rank, runner)
        txn = None if profile else transaction_for(runner)
        start = time.perf_counter()
        self.session, self._failed_at = session, None
        self.target_managers = {id(runner.cudagraph_manager)} if hasattr(runner, "cudagraph_manager") else set()
        try:
            with session.at(phase="profile_cudagraph_memory" if profile else "capture_model"), \
                    runner_hooks(runner, self):
                session.agree_settings(self.settings.agreed())
                session.boundary("phase_begin", graphs=len(plan.descriptors), plan=_digest(plan))
                result = capture()
                session.boundary("phase_end")
        except BaseException as error:
            where = self._failed_at or (session.site.family, session.site.mode, session.site.descriptor,
                                        session.site.phase)
            if not isinstance(error, DivergenceError):
                session.abandon(f"{type(error).__name__}: {error}")
            undo_error = txn.rollback(error) if txn is not None else None
            session.flush()
            return self._failed(error, undo_error, where, rank, what, runner_kind(runner))
        finally:
            self.session = None
            session.flush()
        if txn is not None:
            txn.commit()
            log.info("captured %d graphs on rank %d in %.1f s (%s); vLLM reports %.2f GiB%s",
                     len(plan.descriptors), rank, time.perf_counter() - start, plan.summary(),
                     (result or 0) / (1 << 30), _trace_state(session.tracer))
        return result

    def _validate(self, plan: VllmPlan, rank: int) -> None:
        report = validate(plan.plan, disable=self.settings.disable)
        shown: dict[str, int] = {}
        for d in report.diagnostics:
            shown[d.code] = shown.get(d.code, 0) + 1
            if shown[d.code] <= _SHOWN_PER_CODE:
                (log.error if d.severity is Severity.ERROR else log.warning)("%s", d)
        for code, count in shown.items():
            if count > _SHOWN_PER_CODE:
                log.warning("%s: %d more like these", code, count - _SHOWN_PER_CODE)
        for line in plan.unknowns:
            log.debug("the plan cannot see: %s", line)
        if not report.ok:
            codes = ", ".join(dict.fromkeys(d.code for d in report.errors))
            raise _logged(CaptureError(
                f"graphflow refused to capture {plan.plan.name}: {len(report.errors)} validation error(s) ({codes}); "
                f"first: {report.errors[0]}", phase="validate", rank=rank,
                hint="fix the settings the findings name (GRAPHFLOW_VLLM_WARMUP=real for a placeholder that "
                     "reaches routing), or skip a rule with GRAPHFLOW_VLLM_DISABLE"))

    def _open(self, rank: int, runner: Any) -> CaptureSession:
        """This capture's session: barriers among this engine's ranks only (``engine_group``),
        in a namespace no other engine and no earlier capture of this one uses."""
        import torch.distributed as dist

        world, store = (0,), None
        group = EngineGroup(0, world)
        if dist.is_initialized() and dist.get_world_size() > 1:
            group = engine_group(rank, dist.get_world_size(), runner.vllm_config.parallel_config)
            world = group.members
            store = dist.distributed_c10d._get_default_store()
        if self._log is None:
            tracer = Tracer(self.settings.trace_dir, rank) if self.settings.trace_dir else None
            self._log, self._trace_pid = TraceLog(rank, tracer), os.getpid()
            if tracer is not None:
                atexit.register(self.close_trace)
        return CaptureSession(rank=rank, world=world, store=store, log=self._log, timeout_s=self.settings.timeout_s,
                              namespace=group.namespace(next(_SESSIONS)), agree_calls=self.settings.agree_calls)

    def _failed(self, error: BaseException, undo_error, where: tuple, rank: int, what: str, kind: str) -> Any:
        family, mode, descriptor, phase = where
        if isinstance(error, KeyboardInterrupt):
            raise error
        if isinstance(error, DivergenceError):
            failure: CaptureError = error
        else:
            failure = CaptureError(
                f"CUDA graph {what} failed {f'at {descriptor} ({phase})' if descriptor else 'outside any descriptor'} "
                f"on rank {rank}: "
                f"{type(error).__name__}: {error}", phase=phase or what, descriptor=descriptor, rank=rank,
                hint=_rolled_back(what, kind))
        if undo_error is not None:
            failure.add_note(f"while rolling back: {undo_error!r}")
        if self.settings.on_failure == "eager" and what == "capture":
            log.error("%s; rolled back: serving without CUDA graphs (GRAPHFLOW_VLLM_ON_FAILURE=eager)",
                      failure.message)
            return 0
        if failure is error:
            raise _logged(failure)
        raise _logged(failure) from error

    # -- what the hooks call --------------------------------------------------------------
    @contextlib.contextmanager
    def at_descriptor(self, descriptor: VllmDescriptor) -> Iterator[None]:
        with self.session.at(family=descriptor.family, descriptor=descriptor, mode=descriptor.mode.value):
            with self._noting_failure():
                yield

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        session = self.session
        with session.at(phase=phase), self._noting_failure():
            session.boundary("phase_begin")
            yield
            session.boundary("phase_end")

    @contextlib.contextmanager
    def _noting_failure(self) -> Iterator[None]:
        """Remember where a failure passed first (the innermost site), before the sites unwind."""
        try:
            yield
        except BaseException:
            if self._failed_at is None:
                site = self.session.site
                self._failed_at = (site.family, site.mode, site.descriptor, site.phase)
            raise

    def prepare(self, communicator: Any, tensor: Any) -> None:
        """The ``prepare`` policy's hooks, once per (family, shape, dtype) per process."""
        key = (self.session.site.family, tuple(tensor.shape), tensor.dtype)
        if key in self._prepared:
            return
        for hook in self.settings.prepare:
            hook(communicator, tensor)
        self._prepared.add(key)


def _logged(error: CaptureError) -> CaptureError:
    """``error``, logged: vLLM prints a worker's exception only in the process that
    collects it, so each rank's own line says what it refused or where it failed."""
    log.error("%s", error)
    return error


def _rolled_back(what: str, kind: str) -> str:
    """The failure's hint: what came back. V1 turns the capturing flag on for its capture and
    off after it, V2 never touches it, so the flag is off on V1 and as it was on V2."""
    if what != "capture":
        return "a profiling run: graphflow rolled nothing back (vLLM's profiling cleans up after itself)"
    flag = "capturing flag off" if kind == "v1" else "capturing flag as it was"
    return (f"vLLM's capture state was rolled back ({flag}, graphs and keys cleared, pools and counters "
            "restored, gc unfrozen)")


def _trace_state(tracer: Tracer | None) -> str:
    """What the capture line says of a trace that lost events (``Tracer`` warned when it
    happened): the graphs stand, the trace file does not hold the whole capture."""
    if tracer is None or not tracer.incomplete:
        return ""
    return f"; trace {tracer.path} incomplete, {tracer.lost} events lost"


def _digest(plan: VllmPlan) -> str:
    """A short hash of the descriptors: ranks that planned differently disagree at the first barrier."""
    text = json.dumps([str(d) for d in plan.descriptors])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
