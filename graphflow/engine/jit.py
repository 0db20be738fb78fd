"""JIT kernels (CuTe DSL, Triton): their specializations, their prewarm, and capture tripwires.

A JIT kernel is compiled for each *specialization* of its arguments (dtype, static
shape parts, alignment, architecture) and its module is loaded into a device at its
first launch there. Both must happen before capture: a compile or a module load inside
a stream capture either breaks the capture or, worse, launches work the graph never
records. graphflow makes that a contract:

1. **Registry.** ``JitRegistry.register(kernel)`` wraps a kernel once; calling the
   wrapper computes the call's ``Specialization``, compiles it if needed (CuTe DSL's
   ``cute.compile`` caches nothing: the registry keeps one compiled object per
   specialization for the process's lifetime, and with a ``cache_dir`` exports it so a
   second process loads it instead of compiling), launches it on the current stream
   of the arguments' device (explicitly, never the default stream), and records which
   segment launched which specialization on which device (the pipeline attaches the
   registry to its locus, so it knows the running segment without events).
2. **Prewarm.** ``JitRegistry.prewarm(streams)`` compiles every specialization the
   pipeline's warmup launched (plus those a kernel declares through ``examples``) and
   launches each once, eagerly, on the stream capture will use on each device, then
   synchronizes each device. A kernel that communicates (a collective's) is compiled
   and loaded but never launched: that is what a channel's ``prepare`` warmup policy
   needs (``JitRegistry.prepare_hook``).
3. **Tripwires.** ``JitRegistry.tripwires()`` installs checks on CuTe DSL's compile
   and module load and on Triton's cache miss and module load; while a stream
   captures, each raises a ``CaptureError`` naming the segment, the kernel, the
   specialization and the fix, instead of letting the capture break or record nothing.
   A registered kernel's first launch on a device it was not prewarmed on, and a CuTe
   kernel that launches without ``stream=``, are refused the same way. When no capture
   runs, each costs one check.

See docs/jit.md.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from graphflow.engine.locus import Where
from graphflow.errors import CaptureError
from graphflow.events import Event, EventKind, Phase

__all__ = [
    "CuteKernel",
    "JitKernel",
    "JitRegistry",
    "PrewarmEntry",
    "PrewarmReport",
    "Specialization",
    "Tripwires",
    "TritonKernel",
    "registry",
]


@attrs.frozen(order=True)
class Specialization:
    """One compiled variant of a kernel: its static parts, in the kernel's order, and the
    architecture it targets. The device is not part of it: one compiled object serves
    every device of that architecture, but each device loads its module separately."""

    kernel: str
    parts: tuple[tuple[str, Any], ...] = attrs.field(converter=lambda p: tuple(dict(p).items()))
    arch: str

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in (*self.parts, ("arch", self.arch)))
        return f"{self.kernel}[{inner}]"

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.parts).get(name, default)


@attrs.frozen
class PrewarmEntry:
    """What the prewarm phase did for one specialization on one device.

    ``compiled``: compiled in this prewarm (it was not yet in the registry);
    ``loaded``: read back from the registry's ``cache_dir`` instead of compiled;
    ``launched``: launched once on the capture stream (False for a kernel that
    communicates, which is only loaded).
    """

    spec: Specialization
    device: str
    compiled: bool
    loaded: bool
    launched: bool
    seconds: float = attrs.field(eq=False)


@attrs.frozen
class PrewarmReport:
    """The prewarm phase's account: per-specialization entries, and what it could not do.

    ``unseen`` lists (segment, kernel) pairs a plan declares whose kernel warmup never
    launched and that declares no ``examples``: nothing is known to prewarm for them.
    ``undeclared`` lists (segment, kernel) pairs warmup launched that the plan does not
    declare: prewarmed all the same, worth declaring. ``problems`` are specializations
    that would fail in capture (a CuTe launch without ``stream=``).
    """

    entries: tuple[PrewarmEntry, ...] = ()
    seconds: float = attrs.field(default=0.0, eq=False)
    unseen: tuple[tuple[str, str], ...] = ()
    undeclared: tuple[tuple[str, str], ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def compiled(self) -> int:
        return sum(e.compiled for e in self.entries)

    @property
    def loaded(self) -> int:
        return sum(e.loaded for e in self.entries)

    @property
    def launched(self) -> int:
        return sum(e.launched for e in self.entries)

    @property
    def specializations(self) -> tuple[Specialization, ...]:
        return tuple(dict.fromkeys(e.spec for e in self.entries))

    def summary(self) -> str:
        """One line for the pipeline report."""
        text = (f"{len(self.specializations)} JIT specialization(s) on {len({e.device for e in self.entries})} "
                f"device(s): {self.compiled} compiled, {self.loaded} loaded from cache, {self.launched} launched, "
                f"{self.seconds * 1e3:.1f} ms")
        if self.unseen:
            text += "; not seen in warmup: " + ", ".join(f"{k} in {s}" for s, k in self.unseen)
        if self.problems:
            text += "; problems: " + "; ".join(self.problems)
        return text


# -- kernels --------------------------------------------------------------------------


class JitKernel(abc.ABC):
    """A JIT kernel graphflow knows the specializations of. Subclass ``CuteKernel`` or
    ``TritonKernel``; register the instance with a ``JitRegistry``; call it like the
    function it wraps.

    ``specialize(*args)`` names the static parts of a call (what the compiled code is
    specialized on); ``communicates`` marks a collective's kernel, which prewarm loads
    but never launches.
    """

    kind: ClassVar[str]

    #: Whether a batch size can need a specialization of its own: False for a kernel whose
    #: ``specialize`` keys on nothing the batch size changes (dtypes, a row's length, the
    #: alignment of buffers' base addresses), so that a descriptor needs no warmup of its
    #: own for it (``capture.warmup: auto``). A kernel that says False wrongly is still
    #: refused cold inside capture, by name (``JitRegistry.launch``).
    per_size: bool = True

    def __init__(self, name: str, *, communicates: bool = False):
        self.name = name
        self.communicates = communicates
        self.registry: JitRegistry | None = None

    @abc.abstractmethod
    def specialize(self, *args: Any) -> Mapping[str, Any]:
        """The static parts of a call: dtypes, static shape parts, alignment, options."""

    def device(self, *args: Any) -> torch.device:
        """The device a call runs on: its first tensor argument's."""
        for arg in args:
            if isinstance(arg, torch.Tensor):
                return arg.device
        raise TypeError(f"kernel {self.name}: no tensor argument to take the device from; override device()")

    def arch(self, device: torch.device) -> str:
        """The architecture a call on ``device`` compiles for (``sm_90a``)."""
        return _arch(device)

    def examples(self, size: int, device: torch.device) -> Iterable[tuple]:
        """Argument tuples a descriptor of batch ``size`` on ``device`` launches this kernel
        with, for specializations warmup does not launch. None by default."""
        return ()

    def scratch(self, spec: Specialization, device: torch.device, example: tuple) -> tuple:
        """Arguments to launch ``spec`` with once during prewarm: by default, zero tensors
        shaped, strided and aligned like the ``example`` call warmup recorded."""
        return tuple(_scratch(part, device) for part in example)

    def __call__(self, *args: Any) -> Any:
        if self.registry is None:
            raise RuntimeError(f"kernel {self.name} is not registered: JitRegistry.register(kernel) first")
        return self.registry.launch(self, args)

    # -- what each kind of kernel implements --------------------------------------------
    @abc.abstractmethod
    def _ready(self, spec: Specialization, args: tuple) -> str:
        """Make ``spec`` runnable without compiling at launch: ``"compiled"``, ``"loaded"``
        (from the cache directory) or ``"cached"`` (already there)."""

    @abc.abstractmethod
    def _launch(self, spec: Specialization, args: tuple, stream: Any) -> Any:
        """Launch on ``stream`` (a ``torch.cuda.Stream``, or None off CUDA)."""

    @abc.abstractmethod
    def _load(self, spec: Specialization, args: tuple) -> None:
        """Load ``spec``'s module into the current device without launching it."""

    def _problem(self, spec: Specialization) -> str | None:
        """Why ``spec`` cannot be captured, if it cannot."""
        return None

    def is_compiled(self, spec: Specialization) -> bool:
        """Whether ``spec`` is compiled in this process (a Triton kernel's cache is Triton's)."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class CuteKernel(JitKernel):
    """A CuTe DSL kernel: one ``@cute.jit`` host function per specialization.

    Subclasses implement ``specialize`` (the static parts), ``host(spec)`` (the
    ``@cute.jit`` callable, or an object with a ``@cute.jit`` ``__call__``, whose last
    parameter is ``stream: cuda.CUstream``) and ``arguments(spec, *args)`` (the host
    function's runtime arguments but the stream: pointers, tensors, scalars). The
    compile uses the arguments of the call that needed it, with a fake stream; the
    launch passes the current stream of the call's device.

    ``options`` is ``cute.compile``'s option string; ``--gpu-arch`` is always set to
    the specialization's architecture, so what compiles is what the spec names.
    """

    kind = "cute"

    def __init__(self, name: str, *, options: str = "", communicates: bool = False):
        super().__init__(name, communicates=communicates)
        self.options = options
        self._compiled: dict[Specialization, Any] = {}  # held for the process: JitModule.__del__ unloads
        self._executors: dict[tuple[Specialization, torch.device], Any] = {}
        self._default_stream: dict[Specialization, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    @abc.abstractmethod
    def host(self, spec: Specialization) -> Callable[..., Any]:
        """The ``@cute.jit`` host function compiled for ``spec``."""

    @abc.abstractmethod
    def arguments(self, spec: Specialization, *args: Any) -> tuple:
        """The host function's runtime arguments for a call of ``spec``, without the stream."""

    def source_digest(self) -> str:
        """What the persisted objects depend on besides the spec: the kernel's source file
        and the DSL version (an edit or an upgrade compiles afresh)."""
        module = sys.modules.get(type(self).__module__)
        source = pathlib.Path(getattr(module, "__file__", "") or "")
        text = source.read_bytes() if source.is_file() else type(self).__qualname__.encode()
        return hashlib.sha256(text + _cute_version().encode()).hexdigest()[:16]

    def compiled(self, spec: Specialization) -> Any:
        """The compiled function of ``spec`` (KeyError if it was never compiled or loaded)."""
        return self._compiled[spec]

    def is_compiled(self, spec: Specialization) -> bool:
        return spec in self._compiled

    def executor(self, spec: Specialization, device: torch.device) -> Any:
        """``spec``'s executor on ``device``, its module loaded there by the first request
        (``JitCompiledFunction.to``): launches go through it, so a specialization loaded
        by a prepare hook launches later without loading again."""
        key = (spec, device)
        executor = self._executors.get(key)
        if executor is None:
            executor = self._executors[key] = self._compiled[spec].to(
                device.index if device.type == "cuda" else None)
        return executor

    def _ready(self, spec: Specialization, args: tuple) -> str:
        if spec in self._compiled:
            return "cached"
        with self._lock:
            if spec in self._compiled:
                return "cached"
            cache = self.registry.cache_dir if self.registry is not None else None
            if cache is not None:
                loaded = self._load_persisted(spec, cache)
                if loaded is not None:
                    self._compiled[spec] = loaded
                    return "loaded"
            self._compiled[spec] = self._compile(spec, args)
            if cache is not None:
                self._persist(spec, cache)
            return "compiled"

    def _compile(self, spec: Specialization, args: tuple) -> Any:
        import cutlass.cute as cute
        import cutlass.runtime

        options = f"{self.options} --gpu-arch {spec.arch}".strip()
        with _launch_recorder() as unstreamed:
            compiled = cute.compile(self.host(spec), *self.arguments(spec, *args), cutlass.runtime.make_fake_stream(),
                                    options=options)
        if unstreamed:
            self._default_stream[spec] = tuple(unstreamed)
        return compiled

    def _persist(self, spec: Specialization, cache: pathlib.Path) -> None:
        """Export ``spec`` to ``cache`` (object file, header, metadata), atomically: a
        process reading the cache sees a whole entry or none."""
        name = self._file_stem(spec)
        folder = cache / _safe(self.name)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            self._compiled[spec].export_to_c(tmp, name, name)
            (pathlib.Path(tmp) / f"{name}.json").write_text(json.dumps(
                {"spec": str(spec), "default_stream": list(self._default_stream.get(spec, ()))}))
            for suffix in (".h", ".json", ".o"):  # the object last: its presence marks the entry whole
                os.replace(pathlib.Path(tmp) / f"{name}{suffix}", folder / f"{name}{suffix}")

    def _load_persisted(self, spec: Specialization, cache: pathlib.Path) -> Any | None:
        name = self._file_stem(spec)
        folder = cache / _safe(self.name)
        if not (folder / f"{name}.o").is_file():
            return None
        import cutlass.cute as cute

        meta = json.loads((folder / f"{name}.json").read_text())
        if meta.get("default_stream"):
            self._default_stream[spec] = tuple(meta["default_stream"])
        return getattr(cute.runtime.load_module(str(folder / f"{name}.o")), name)

    def _file_stem(self, spec: Specialization) -> str:
        digest = hashlib.sha256(f"{spec!s}|{self.source_digest()}".encode()).hexdigest()[:20]
        return f"k{digest}"

    def _launch(self, spec: Specialization, args: tuple, stream: Any) -> Any:
        import cuda.bindings.driver as cuda

        handle = 0 if stream is None else stream.cuda_stream
        return self.executor(spec, self.device(*args))(*self.arguments(spec, *args), cuda.CUstream(handle))

    def _load(self, spec: Specialization, args: tuple) -> None:
        self.executor(spec, self.device(*args))

    def _problem(self, spec: Specialization) -> str | None:
        kernels = self._default_stream.get(spec)
        if kernels:
            return (f"{spec} launches {', '.join(kernels)} without stream=: on the default stream, outside the "
                    f"capture, so the graph would silently lack it — pass stream=stream to .launch() in the "
                    f"@cute.jit host function")
        return None


class TritonKernel(JitKernel):
    """A Triton kernel, through the Python function that launches it.

    ``launch(*args)`` is that function (it computes the grid and calls
    ``kernel[grid](...)``); ``specialize(*args)`` names what Triton specializes on
    (dtypes, constexprs such as the block size, alignment to 16 bytes). Triton
    compiles and caches per device by itself: the registry records, prewarms and
    checks, and the tripwires watch Triton's own cache for what ``specialize`` misses.
    """

    kind = "triton"

    def __init__(self, name: str, launch: Callable[..., Any], specialize: Callable[..., Mapping[str, Any]], *,
                 communicates: bool = False, per_size: bool = True):
        super().__init__(name, communicates=communicates)
        self.launch = launch
        self._specialize = specialize
        self.per_size = per_size

    def specialize(self, *args: Any) -> Mapping[str, Any]:
        return self._specialize(*args)

    def is_compiled(self, spec: Specialization) -> bool:
        return False  # known only to Triton's per-device cache: a cold launch may compile

    def _ready(self, spec: Specialization, args: tuple) -> str:
        return "cached"  # Triton compiles in the launch; the tripwires watch its cache

    def _launch(self, spec: Specialization, args: tuple, stream: Any) -> Any:
        return self.launch(*args)  # Triton launches on the current stream, which the caller set

    def _load(self, spec: Specialization, args: tuple) -> None:
        raise CaptureError(f"Triton kernel {self.name} cannot be loaded without launching it",
                           hint="mark only CuTe DSL kernels 'communicates'; launch Triton kernels in prewarm")


# -- the registry ---------------------------------------------------------------------

#: Where the registry is when no pipeline is attached.
_NOWHERE = Where()


class JitRegistry:
    """The JIT kernels of a process, what each pipeline launched, and their prewarm state.

    ``run_pipeline`` attaches the process's ``registry`` to its locus (``attach``) for
    the run, so it reads the running phase, region and segment where the engine keeps
    them; another registry can join a run as a listener (``on_event`` attaches it at
    PIPELINE_BEGIN). ``cache_dir`` (default: the
    ``GRAPHFLOW_JIT_CACHE`` environment variable, if set) persists compiled CuTe
    specializations across processes.
    """

    #: As a listener it needs the pipeline's begin and end only.
    segment_events = False

    def __init__(self, *, cache_dir: str | os.PathLike | None = None):
        cache_dir = cache_dir if cache_dir is not None else os.environ.get("GRAPHFLOW_JIT_CACHE")
        self.cache_dir = pathlib.Path(cache_dir) if cache_dir else None
        self._kernels: dict[str, JitKernel] = {}
        self._warm: set[tuple[Specialization, torch.device]] = set()  # launched or loaded eagerly there
        self._examples: dict[Specialization, tuple] = {}  # the first call's arguments, described
        self._uses: dict[tuple[str, str], set[tuple[Specialization, torch.device]]] = {}  # this pipeline's
        self._locus = None  # the attached pipeline's (graphflow.engine.locus.Locus)
        self._thread: int | None = None  # the thread that pipeline runs in
        self._predicate: Callable[[], bool] | None = None  # the installed tripwires' capture predicate

    # -- kernels ------------------------------------------------------------------------
    def register(self, kernel: JitKernel) -> JitKernel:
        """Register ``kernel`` under its name (once) and return it."""
        known = self._kernels.get(kernel.name)
        if known is not None and known is not kernel:
            raise ValueError(f"a JIT kernel named {kernel.name!r} is already registered ({known!r})")
        self._kernels[kernel.name] = kernel
        kernel.registry = self
        return kernel

    def kernel(self, name: str) -> JitKernel:
        try:
            return self._kernels[name]
        except KeyError:
            raise KeyError(f"no JIT kernel named {name!r}: registered are {sorted(self._kernels)}") from None

    @property
    def kernels(self) -> tuple[JitKernel, ...]:
        return tuple(self._kernels.values())

    def spec(self, kernel: JitKernel, args: tuple) -> Specialization:
        return Specialization(kernel.name, kernel.specialize(*args), kernel.arch(kernel.device(*args)))

    def is_warm(self, spec: Specialization, device: torch.device | str) -> bool:
        return (spec, _indexed(device)) in self._warm

    def uses(self) -> dict[tuple[str, str], frozenset[tuple[Specialization, torch.device]]]:
        """(segment, kernel) → the (specialization, device) pairs the current pipeline launched."""
        return {key: frozenset(value) for key, value in self._uses.items()}

    # -- the call path ------------------------------------------------------------------
    def launch(self, kernel: JitKernel, args: tuple) -> Any:
        """Run one call of ``kernel``: refuse a cold one inside capture, else compile if
        needed, launch on the current stream of its device, and record it."""
        spec = self.spec(kernel, args)
        device = kernel.device(*args)
        capturing = self.capturing()
        if capturing:
            self._check_capturable(kernel, spec, device)
        kernel._ready(spec, args)
        result = kernel._launch(spec, args, _current_stream(device))
        if not capturing:
            self._warm.add((spec, device))
        self._record(kernel, spec, device, args)
        return result

    def prepare(self, kernel: JitKernel | str, *args: Any) -> Specialization:
        """Compile ``kernel``'s specialization for ``args`` and load it into their device,
        without launching it, once per (specialization, device): what a collective's
        ``prepare`` hook does (no communication). Returns the specialization."""
        kernel = self.kernel(kernel) if isinstance(kernel, str) else kernel
        spec = self.spec(kernel, args)
        device = kernel.device(*args)
        if (spec, device) not in self._warm:
            if self.capturing():
                self._check_capturable(kernel, spec, device)
            kernel._ready(spec, args)
            with _on_device(device):
                kernel._load(spec, args)
            self._warm.add((spec, device))
        self._record(kernel, spec, device, args)
        return spec

    def prepare_hook(self, kernel: JitKernel | str,
                     arguments: Callable[[torch.Tensor], tuple] | None = None) -> Callable[[torch.Tensor], None]:
        """A channel ``prepare`` hook (``ChannelHandle.set_prepare``): for each input
        tensor, ``prepare(kernel, *arguments(tensor))`` (default: the tensor alone)."""
        def hook(tensor: torch.Tensor) -> None:
            self.prepare(kernel, *(arguments(tensor) if arguments is not None else (tensor,)))

        return hook

    def capturing(self) -> bool:
        """Whether a capture is running: the installed tripwires' predicate when they were
        given one, else ``pipeline_capturing()``."""
        return (self._predicate or self.pipeline_capturing)()

    def pipeline_capturing(self) -> bool:
        """The pipeline is inside a region of its capture phase (from events), or the
        current CUDA stream is capturing."""
        site = self.site
        if site.phase is Phase.CAPTURE and site.region is not None:
            return True
        return _cuda_capturing()

    @property
    def site(self) -> Where:
        """Where the attached pipeline is; nowhere when none is attached."""
        if self._locus is None or threading.get_ident() != self._thread:
            return _NOWHERE
        return self._locus.here

    def _check_capturable(self, kernel: JitKernel, spec: Specialization, device: torch.device) -> None:
        problem = kernel._problem(spec)
        if problem is not None:
            raise self.cold_error(f"JIT kernel {problem}; refused", kernel=kernel.name, hint=(
                "pass the stream the host function receives to every .launch(), then rerun"))
        if (spec, device) in self._warm:
            return
        what = "compiled" if not kernel.is_compiled(spec) else "launched"
        on = f" on {device}"
        if any(s == spec for s, _ in self._warm):
            on += " (it was prewarmed on other devices only)"
        raise self.cold_error(f"JIT kernel {kernel.name} specialization {spec} would be first {what}{on}",
                              kernel=kernel.name, device=device)

    def cold_error(self, message: str, *, kernel: str, device: torch.device | None = None,
                   hint: str | None = None) -> CaptureError:
        """The CaptureError for a cold compile, load or launch inside capture: ``message``
        says what happened; where (segment, descriptor) and the fix are added here."""
        site = self.site
        segment = site.segment
        if hint is None and kernel in self._kernels:
            who = segment or "(the one that launches it)"
            on = f" on {device}" if device is not None else ""
            hint = (f"declare prewarm for {kernel}: list it in the kernels of segment {who} and make warmup "
                    f"launch it{on} (or give {kernel} examples()); for a collective's kernel, prepare it in the "
                    f"channel's prepare hook (JitRegistry.prepare_hook). The prewarm phase then compiles it and "
                    f"launches it once on each device's capture stream")
        elif hint is None:
            hint = (f"declare prewarm for {kernel}: register it with graphflow.engine.jit (a CuteKernel or TritonKernel) "
                    f"so the prewarm phase compiles, loads and launches it on every capture stream, or run it "
                    f"once outside capture on every device first")
        where = f" of segment {segment}" if segment else ""
        return CaptureError(f"{message} inside the capture{where}", phase=Phase.CAPTURE.value,
                            descriptor=site.descriptor, segment=segment, hint=hint)

    def _record(self, kernel: JitKernel, spec: Specialization, device: torch.device, args: tuple) -> None:
        if spec not in self._examples:
            self._examples[spec] = tuple(_describe(a) for a in args)
        segment = self.site.segment
        if segment is not None:
            self._uses.setdefault((segment, kernel.name), set()).add((spec, device))

    # -- the pipeline -------------------------------------------------------------------
    def attach(self, locus) -> None:
        """Follow a pipeline (its ``Locus``) from now on, in the calling thread; its uses
        start empty. Another thread (a runtime serving beside a background capture) is
        nowhere in that pipeline."""
        self._locus = locus
        self._thread = threading.get_ident()
        self._uses = {}

    def detach(self, locus=None) -> None:
        """Stop following a pipeline (only ``locus``'s, when given: a later pipeline may
        have attached since)."""
        if locus is None or self._locus is locus:
            self._locus = None

    def on_event(self, event: Event) -> None:
        """As a listener: attach at PIPELINE_BEGIN, detach when the pipeline ends."""
        if event.kind is EventKind.PIPELINE_BEGIN:
            self.attach(event.locus)
        elif event.kind in (EventKind.PIPELINE_END, EventKind.ROLLBACK):
            self.detach()

    # -- prewarm ------------------------------------------------------------------------
    def prewarm(self, streams: Mapping[torch.device, Any], *, sizes: Sequence[int] = (),
                declared: Mapping[str, Sequence[str]] | None = None) -> PrewarmReport:
        """Compile every specialization this pipeline needs and launch each once, eagerly,
        on the capture stream of every device in ``streams``, then synchronize each.

        What is needed: every specialization the pipeline's warmup launched, and those
        the ``declared`` kernels' ``examples(size, device)`` give for each of ``sizes``.
        ``declared`` maps segment name → kernel names (the plan's ``Segment.kernels``);
        it also fills the report's ``unseen`` and ``undeclared``. Kernels that
        communicate are compiled and loaded, never launched.
        """
        start = time.perf_counter()
        checked = declared is not None
        declared = {s: tuple(k) for s, k in (declared or {}).items() if k}
        wanted: dict[Specialization, tuple[JitKernel, tuple | None]] = {}
        for (segment, name), pairs in sorted(self._uses.items()):
            for spec, _ in sorted(pairs, key=lambda p: (p[0], str(p[1]))):
                wanted.setdefault(spec, (self._kernels[name], None))
        streams = {_indexed(d): stream for d, stream in streams.items()}
        devices = list(streams)
        for name in dict.fromkeys(k for names in declared.values() for k in names):
            kernel = self._kernels.get(name)
            if kernel is None:
                continue
            for device in devices:
                for size in sizes:
                    for args in kernel.examples(size, device):
                        wanted.setdefault(self.spec(kernel, tuple(args)), (kernel, tuple(args)))
        entries = []
        problems = []
        for spec, (kernel, given) in wanted.items():
            problem = kernel._problem(spec)
            if problem is not None:
                problems.append(problem)
            for device in devices:
                entries.append(self._prewarm_one(kernel, spec, device, streams[device], given))
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        launched = {name for _, name in self._uses}
        unseen = tuple((s, k) for s, names in declared.items() for k in names
                       if k in self._kernels and k not in launched and not any(e.spec.kernel == k for e in entries))
        undeclared = tuple(sorted(key for key in self._uses if checked and key[1] not in declared.get(key[0], ())))
        return PrewarmReport(tuple(entries), time.perf_counter() - start, unseen, undeclared, tuple(problems))

    def _prewarm_one(self, kernel: JitKernel, spec: Specialization, device: torch.device, stream: Any,
                     given: tuple | None) -> PrewarmEntry:
        start = time.perf_counter()
        args = given if given is not None else kernel.scratch(spec, device, self._examples[spec])
        if self.spec(kernel, args) != spec:
            raise CaptureError(f"prewarm arguments of {kernel.name} specialize to {self.spec(kernel, args)}, not {spec}",
                               phase=Phase.PREWARM.value,
                               hint=f"override {type(kernel).__name__}.scratch() to build arguments of that "
                                    f"specialization")
        how = kernel._ready(spec, args)
        with _on_device(device), _on_stream(stream):
            if kernel.communicates:
                kernel._load(spec, args)
            else:
                kernel._launch(spec, args, stream)
        self._warm.add((spec, device))
        return PrewarmEntry(spec, str(device), how == "compiled", how == "loaded", not kernel.communicates,
                            time.perf_counter() - start)

    # -- tripwires ----------------------------------------------------------------------
    def tripwires(self, capturing: Callable[[], bool] | None = None) -> Tripwires:
        """The capture tripwires, as a context manager (``with registry.tripwires():``).

        ``capturing`` replaces ``pipeline_capturing`` as the capture predicate, for the
        registry's own checks too, while they are installed."""
        return Tripwires(self, capturing)


class Tripwires:
    """Checks on CuTe DSL's and Triton's compile and module load that refuse them inside
    a capture, installed on ``__enter__`` (or ``install()``) and removed on exit.

    Patched: ``CompileCallable._compile`` and ``JitCompiledFunction.to`` (with
    ``CudaDialectJitCompiledFunction.to``) of CuTe DSL, when it is imported; Triton's
    ``knobs.runtime.jit_cache_hook`` (chained to any hook already set) and
    ``CompiledKernel._init_handles``, when Triton is imported; a compile-start callback
    of torch.compile's dynamo, when it is imported (a recompile inside capture). The load check wraps
    ``_init_handles`` rather than using ``kernel_load_start_hook``: an exception from
    that hook leaves the kernel half initialized (its launcher set, no function), so
    the next launch would pass a null function. ``capturing`` is the predicate (the
    registry's by default; tests switch it). Nesting is allowed.
    """

    def __init__(self, registry: JitRegistry, capturing: Callable[[], bool] | None = None):
        self.registry = registry
        self.capturing = capturing or registry.pipeline_capturing
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Tripwires:
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    @property
    def installed(self) -> bool:
        return bool(self._undo)

    def install(self) -> None:
        if self._undo:
            return
        registry, previous = self.registry, self.registry._predicate
        registry._predicate = self.capturing

        def restore() -> None:
            registry._predicate = previous

        self._undo.append(restore)
        try:
            if "cutlass" in sys.modules:
                self._install_cute()
            if "triton" in sys.modules:
                self._install_triton()
            if "torch._dynamo" in sys.modules:
                self._install_dynamo()
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patch(self, owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _refuse(self, what: str, kernel: str) -> CaptureError:
        return self.registry.cold_error(what, kernel=kernel)

    def _install_cute(self) -> None:
        from cutlass.base_dsl.compiler import CompileCallable
        from cutlass.base_dsl.jit_executor import JitCompiledFunction
        from cutlass.cutlass_dsl.cuda_jit_executor import CudaDialectJitCompiledFunction

        capturing, refuse = self.capturing, self._refuse

        def compile_(original):
            def _compile(self, func, *args, **kwargs):
                if capturing():
                    name = getattr(func, "__qualname__", None) or type(func).__qualname__
                    raise refuse(f"CuTe DSL compile of {name}", name)
                return original(self, func, *args, **kwargs)
            return _compile

        def load(original):
            def to(self, device=None):
                if capturing():
                    name = getattr(self, "function_name", None) or "a CuTe DSL function"
                    raise refuse(f"CuTe DSL module load of {name}", name)
                return original(self, device)
            return to

        self._patch(CompileCallable, "_compile", compile_)
        self._patch(JitCompiledFunction, "to", load)
        self._patch(CudaDialectJitCompiledFunction, "to", load)

    def _install_triton(self) -> None:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel

        capturing, refuse = self.capturing, self._refuse
        previous = knobs.runtime.jit_cache_hook

        def cache_miss(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            if capturing():
                raise refuse(f"Triton compile of {repr} (an in-memory cache miss on device {compile['device']})",
                             fn.name)
            if previous is not None:
                return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                already_compiled=already_compiled)
            return None

        knobs.runtime.jit_cache_hook = cache_miss

        def restore() -> None:
            knobs.runtime.jit_cache_hook = previous

        self._undo.append(restore)

        def load(original):
            def _init_handles(self):
                if self.module is None and capturing():
                    raise refuse(f"Triton module load of {self.name}", self.name)
                return original(self)
            return _init_handles

        self._patch(CompiledKernel, "_init_handles", load)


    def _install_dynamo(self) -> None:
        """Refuse a torch.compile compile (a guard that failed, a frame never compiled)
        while capturing: dynamo calls its compile-start callbacks before it traces, so
        nothing of the new frame has run. Dynamo wraps what the callback raises; a
        compiled segment (``graphflow.engine.model.compiled``) unwraps it."""
        from torch._dynamo.callback import callback_handler

        capturing, registry = self.capturing, self.registry

        def on_compile_start(args) -> None:
            if not capturing():
                return
            reason = _recompile_reason()
            what = f"torch.compile recompile ({reason})" if reason else "torch.compile compile of a frame warmup never ran"
            raise registry.cold_error(what, kernel="torch.compile", hint=(
                "warmup compiles each specialization of a compiled segment; this one was not warmed: its guards "
                "depend on something that changed between warmup and capture (a Python attribute it reads, a "
                "tensor's shape, dtype or device, grad mode) or on a path warmup did not take. Keep that fixed "
                "between warmup and capture, or set compile: false on the segment"))

        callback_handler.register_start_callback(on_compile_start)
        self._undo.append(lambda: callback_handler.remove_start_callback(on_compile_start))


def _recompile_reason() -> str | None:
    """Dynamo's reason for the compile under way (the guard that failed), when it gives one."""
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except Exception:  # noqa: BLE001 - a detail for the message only
        return None
    return str(reason).strip().splitlines()[0] if reason else None


#: The process's registry: graphflow's own kernels (the dsv4 model's) register here.
registry = JitRegistry()


# -- helpers --------------------------------------------------------------------------


@contextlib.contextmanager
def _launch_recorder() -> Iterator[list[str]]:
    """Record the kernels a CuTe DSL trace launches without ``stream=`` (to the default
    stream, which a capture does not record)."""
    from cutlass.cutlass_dsl.cutlass import KernelLauncher

    unstreamed: list[str] = []
    original = KernelLauncher.__dict__["launch"]

    def launch(self, *args, **kwargs):
        if kwargs.get("stream") is None:
            unstreamed.append(getattr(self.funcBody, "__name__", "a kernel"))
        return original(self, *args, **kwargs)

    KernelLauncher.launch = launch
    try:
        yield unstreamed
    finally:
        KernelLauncher.launch = original


def _cuda_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _indexed(device: torch.device | str) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current device), as tensors name their device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _on_stream(stream: Any) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def _arch(device: torch.device) -> str:
    """``CUTE_DSL_ARCH`` when set (compiling with no GPU), else the device's ``sm_XY``,
    with the ``a`` suffix CuTe DSL needs from Hopper on."""
    return _device_arch(device, os.environ.get("CUTE_DSL_ARCH"))


@functools.lru_cache(maxsize=None)
def _device_arch(device: torch.device, forced: str | None) -> str:
    if forced:
        return forced
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def _cute_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001 - an unpacked tree has no metadata
        import cutlass

        return str(getattr(cutlass, "__version__", "unknown"))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _alignment(tensor: torch.Tensor) -> int:
    """The largest power of two (up to 16) that the tensor's address is a multiple of."""
    ptr = tensor.data_ptr()
    align = 16
    while align > 1 and ptr % align:
        align //= 2
    return align


def _describe(arg: Any) -> tuple:
    if isinstance(arg, torch.Tensor):
        return ("tensor", tuple(arg.shape), tuple(arg.stride()), arg.dtype, _alignment(arg))
    return ("value", arg)


def _scratch(part: tuple, device: torch.device) -> Any:
    """A zero tensor like a described one, on ``device``, at the same alignment."""
    if part[0] == "value":
        return part[1]
    _, shape, stride, dtype, align = part
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0) if all(shape) else 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    pad = 32 // itemsize + 1  # room to move the start to exactly ``align`` bytes (allocations are 512-aligned)
    base = torch.zeros(span + pad, dtype=dtype, device=device)
    offset = 0
    while offset < pad - 1 and _alignment(base[offset:]) != align:
        offset += 1
    return base.as_strided(shape, stride, offset)
