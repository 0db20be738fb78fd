"""The capture plan: what a model declares, as small frozen attrs classes.

A plan is data only. It knows nothing of YAML (see ``graphflow.plan.loader``), of rules
(see ``graphflow.plan.rules``) or of GPUs (see ``graphflow.engine``), and it imports no
torch, so ``graphflow validate`` starts in milliseconds and runs where torch is absent.
Each field declares what it may hold (``graphflow.plan.fields``): building an element with a
wrong type or a value out of range raises at once, naming the field, whether the plan
comes from Python, a decorated model or YAML.

Derived views are computed here because every consumer needs the same answer:

* ``Plan.dag()``: a networkx DiGraph over segment names. Segments run in the order
  listed; a buffer is versioned at each write, so a reader depends on the writer of the
  version it reads (``raw`` edge) and a writer depends on the readers of the version it
  replaces (``war`` edge). An in-place update therefore orders segments instead of
  making a cycle. ``after`` adds explicit ordering edges (``after`` kind).
* ``Plan.regions(mode)``: PIECEWISE regions are maximal runs of graph segments between
  eager breaks, per family; the FULL region of a family is its whole step.
* ``Plan.storage(name)`` and ``Plan.allocated_shape(buffer)``: which buffer owns the
  memory a name uses (alias chains followed to their root), and the shape it is
  allocated at (capacities included), for the validator, ``show`` and the engine alike.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Union

import attrs
import networkx as nx

from graphflow.plan.fields import (
    Bounds,
    Choice,
    Data,
    Dimension,
    Elements,
    Flag,
    Instance,
    Integer,
    Number,
    OneOf,
    Optional,
    Sequence as Items,
    Setting,
    Table,
    Text,
    field,
)

__all__ = [
    "Buffer",
    "BufferRole",
    "CaptureRegion",
    "CaptureSettings",
    "Channel",
    "ChannelKind",
    "COMPILE_DEFAULTS",
    "Compile",
    "Descriptor",
    "Dim",
    "Family",
    "Mode",
    "holders",
    "Origin",
    "Plan",
    "Prewarm",
    "Reference",
    "Segment",
    "SegmentKind",
    "Stream",
    "Warmup",
    "WarmupPolicy",
    "DTYPE_ALIASES",
    "DTYPE_BYTES",
    "PAD_KEEP",
    "alias_chain",
    "dataflow_edges",
    "eval_dim",
    "dim_symbols",
]


class SegmentKind(enum.Enum):
    GRAPH = "graph"
    EAGER = "eager"


class Mode(enum.Enum):
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"


class Warmup(enum.Enum):
    """Which descriptors warm up before their capture (``capture.warmup``).

    ``each``: every descriptor, one eager step (``warmup_iters``) before its capture.
    ``auto``: only the descriptors that need it (the first of each mode, those verify
    compares and those the detectors watch); the rest go straight to capture, since the
    kernels, the allocator and cuBLAS are warm from the larger sizes warmed before them.
    A plan whose warmup does per-size work that capture depends on warms each anyway
    (``graphflow.engine.context.per_size_warmup`` says when, and why).
    """

    EACH = "each"
    AUTO = "auto"


class WarmupPolicy(enum.Enum):
    """What a channel's collective does during warmup, before its graphs are captured.

    Only ``real`` gives every rank the reduced value; the others give each rank its own
    local data, which is harmless for dense math and fatal for routing (GF503).
    """

    REAL = "real"  # run the real collective
    PREPARE = "prepare"  # run the channel's prewarm hook; no communication
    PLACEHOLDER = "placeholder"  # allocate (deterministically filled) only


class ChannelKind(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


class BufferRole(enum.Enum):
    INPUT = "input"  # filled by the runtime before each step
    OUTPUT = "output"  # read by the runtime after each step
    STATE = "state"  # persists across steps (a KV cache); snapshotted around verify
    INTERNAL = "internal"  # written and read inside the step only


#: Bytes per element of each dtype a plan may name (torch's names, without ``torch.``).
DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

#: Other spellings of those dtypes, in lower case: torch's own aliases (``torch.half``,
#: ``torch.float``, ``torch.long``...) and the short names of papers and model configs
#: (``bf16``, ``fp8``), each to the dtypes it may mean. A plan names one dtype one way;
#: these only answer a refused spelling with what it meant.
DTYPE_ALIASES: Mapping[str, tuple[str, ...]] = {
    "double": ("float64",), "fp64": ("float64",), "f64": ("float64",),
    "float": ("float32",), "fp32": ("float32",), "f32": ("float32",), "single": ("float32",),
    "half": ("float16",), "fp16": ("float16",), "f16": ("float16",),
    "bf16": ("bfloat16",), "bfloat": ("bfloat16",), "brain_float16": ("bfloat16",),
    "fp8": ("float8_e4m3fn", "float8_e5m2"), "float8": ("float8_e4m3fn", "float8_e5m2"),
    "e4m3": ("float8_e4m3fn",), "fp8_e4m3": ("float8_e4m3fn",), "float8_e4m3": ("float8_e4m3fn",),
    "e5m2": ("float8_e5m2",), "fp8_e5m2": ("float8_e5m2",),
    "long": ("int64",), "i64": ("int64",), "int": ("int32",), "i32": ("int32",), "short": ("int16",),
    "i16": ("int16",), "char": ("int8",), "i8": ("int8",), "byte": ("uint8",), "u8": ("uint8",),
    "boolean": ("bool",),
}

#: A shape dimension: an int, a symbol (``"B"``) or a product of both (``"2*B"``).
Dim = Union[int, str]

_TERM = r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*))\s*"
_DIM_TERM = re.compile(rf"^{_TERM}$")
#: How a dimension string is spelled: terms (a positive int or a symbol) joined by ``*``.
DIM_PATTERN = rf"{_TERM}(?:\*{_TERM})*"
#: A symbol or symbol-like name: letters, digits and ``_``, not starting with a digit.
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"


def dim_symbols(dim: Dim) -> tuple[str, ...]:
    """The symbols a dimension uses; raises ValueError on anything but ``a*b*...``."""
    if isinstance(dim, int):
        return ()
    names = []
    for term in str(dim).split("*"):
        match = _DIM_TERM.match(term)
        if match is None:
            raise ValueError(f"bad shape dimension {dim!r}: use an int, a symbol or a product like '2*B'")
        if match.group(2):
            names.append(match.group(2))
    return tuple(names)


def eval_dim(dim: Dim, values: Mapping[str, int]) -> int:
    """Evaluate a dimension with the given symbol values (KeyError for an unknown one)."""
    if isinstance(dim, int):
        return dim
    result = 1
    for term in str(dim).split("*"):
        match = _DIM_TERM.match(term)
        if match is None:
            raise ValueError(f"bad shape dimension {dim!r}")
        result *= int(match.group(1)) if match.group(1) else values[match.group(2)]
    return result


# -- field kinds (graphflow.plan.fields): what one value may be -------------------------------
_NAME = Text()
_SYMBOL = Text(IDENTIFIER, "a symbol name (letters, digits and _)")
#: ``cuda`` alone means "the current GPU", which differs per process and thread: capture
#: on another GPU then records empty graphs, so a device always names its index.
_DEVICE = Text(r"cpu|cuda:\d+", "'cpu' or 'cuda:N' with the GPU's index (a bare 'cuda' is whichever GPU is "
                                "current)")
_SIZES = Items(Integer(minimum=1), "descriptor sizes (ints >= 1)")
_FACTORY = Text(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", "a factory 'package.module:function'")
#: A keyword argument of the callable a segment or reference calls.
_KEYWORD = Text(IDENTIFIER, "a keyword argument name")
#: An attribute path on the model (digits index ModuleLists): ``cache.layers.0.keys``.
_PATH = Text(r"[A-Za-z_0-9][\w]*(?:\.[A-Za-z_0-9][\w]*)*", "an attribute path on the model, e.g. cache.layers.0.keys")
#: A submodule path pattern: attribute names, indices or ``*`` (any one), joined by dots.
_PATTERN = Text(r"(?:[\w]+|\*)(?:\.(?:[\w]+|\*))*", "a submodule path such as model.layers.*.self_attn")
#: What a padded row of a buffer holds: a number (an input's fill value, such as a scratch
#: slot index) or ``keep`` (a state buffer's padded rows are saved and restored around the step).
PAD_KEEP = "keep"
_PAD = OneOf((Number(), Choice((PAD_KEEP,))))


@attrs.frozen
class Origin:
    """Where an element was declared, so diagnostics can name file and line."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@attrs.frozen
class Buffer:
    """A static tensor, allocated once at its largest descriptor size before capture.

    ``capacity`` gives the rows this buffer holds along a symbol (a KV cache for 64
    sequences): it is allocated at ``max(largest descriptor, capacity)``
    (``Plan.allocated_shape``), the runtime's eager fallback may use it for larger
    batches, and a descriptor above it cannot be captured (GF604). ``alias_of``
    declares that this buffer is a view of another's storage: writes to either are
    writes to both; the target may itself be an alias (``Plan.storage`` follows the
    chain). ``values`` is the half-open range ``[low, high)`` that verify draws random
    inputs from (token ids need ``[0, vocab)``); floats default to a standard normal.

    ``adopt`` makes a tensor the model holds (``cache.layers.0.keys``) this buffer: the
    model's tensor is the storage when it has the buffer's allocated shape, else the
    engine allocates the buffer and sets the attribute to it; either way the model's
    own code and the plan see one tensor, which is counted, snapshotted by verify and
    ordered by the DAG like any buffer (``graphflow.engine.model.adopt``). ``pad`` says what
    the rows a smaller batch does not use hold when it runs on a larger descriptor: a
    number for an input (a scratch slot index its padded rows map to; zero without
    it), ``keep`` for a state buffer indexed by batch row (those rows are saved before
    the step and put back after, so padding never changes another sequence's state).
    """

    name: str = field(_NAME)
    shape: tuple[Dim, ...] = field(Items(Dimension(DIM_PATTERN), "dimensions (ints or symbols like B, 2*B)"))
    dtype: str = field(Choice(tuple(DTYPE_BYTES), aliases=DTYPE_ALIASES), doc="torch's dtype name, without 'torch.'")
    device: str = field(_DEVICE)
    role: BufferRole = field(Choice.of(BufferRole), default=BufferRole.INTERNAL)
    capacity: Mapping[str, int] = field(Table(_SYMBOL, Integer(minimum=1), "symbols to the rows the buffer holds", sort=True),
                                        factory=dict, hash=False,
                                        doc="the rows this buffer holds along a symbol, at least")
    alias_of: str | None = field(Optional(_NAME), default=None, doc="the buffer whose storage this one views")
    values: tuple[float, float] | None = field(Optional(Bounds()), default=None,
                                               doc="[low, high) that verify draws random inputs from")
    adopt: str | None = field(Optional(_PATH), default=None,
                              doc="the model's tensor this buffer is: an attribute path such as cache.layers.0.keys")
    pad: float | str | None = field(Optional(_PAD), default=None,
                                    doc="what padded rows hold: a number (an input's fill value) or keep (a state "
                                        "buffer's rows are saved and restored around the step)")

    def symbols(self) -> tuple[str, ...]:
        return tuple(s for dim in self.shape for s in dim_symbols(dim))

    def numel(self, values: Mapping[str, int]) -> int:
        n = 1
        for dim in self.shape:
            n *= eval_dim(dim, values)
        return n

    def nbytes(self, values: Mapping[str, int]) -> int:
        return self.numel(values) * DTYPE_BYTES[self.dtype]


@attrs.frozen
class Stream:
    """An explicit capture stream on one device.

    Capturing on the ambient stream after ``set_device`` records an empty graph on one
    GPU and replays stale data on the others; a stream created on the segment's own
    device is what makes capture on any GPU but the first work.
    """

    name: str = field(_NAME)
    device: str = field(_DEVICE)


@attrs.frozen
class Channel:
    """A communication channel owned by one family, with a semantic id.

    ``jit`` marks a collective whose kernel is specialized at first launch (CuTe DSL,
    Triton): it must be warmed by a real warmup or by the ``prewarm`` hook it names.
    """

    name: str = field(_NAME)
    kind: ChannelKind = field(Choice.of(ChannelKind))
    group: str = field(_NAME)
    id: int = field(Integer(), doc="the semantic channel id")
    family: str = field(_NAME, doc="the owning family")
    warmup: WarmupPolicy = field(Choice.of(WarmupPolicy), default=WarmupPolicy.REAL)
    prewarm: str | None = field(Optional(_NAME), default=None, doc="the prewarm hook that warms its kernel")
    jit: bool = field(Flag(), default=False)


#: The torch.compile backends a segment may use: inductor generates fused kernels;
#: aot_eager and eager trace with dynamo and run the traced graph as it is (for
#: finding graph breaks and recompiles quickly). Inductor's own CUDA graphs are never
#: used: graphflow captures the segments itself (rule GF702).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
#: torch.compile's modes; ``reduce-overhead`` and ``max-autotune`` capture CUDA graphs
#: of their own, which GF702 refuses.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@attrs.frozen
class Compile:
    """``torch.compile`` for graph segments, set per plan (``capture.compile``) and per
    segment (``compile``); docs/compile.md.

    Every field left unset (None) inherits: a segment's setting from the plan's, the
    plan's from graphflow's defaults (``COMPILE_DEFAULTS``). So a segment that says only
    ``{mode: max-autotune-no-cudagraphs}`` keeps the plan's backend and strictness,
    and ``compile: false`` takes one segment out. ``dynamic`` is False by default:
    graphflow warms and captures each batch size on its own, so each gets kernels
    specialized to its shape. ``strict`` makes a segment dynamo cannot compile fail the
    pipeline instead of running uncompiled with a warning; ``fullgraph`` makes a graph
    break such a failure. ``options`` are inductor's options (``torch.compile(options=)``),
    applied over the mode's.
    """

    enabled: bool | None = field(Optional(Flag()), default=None, doc="false: not compiled")
    backend: str | None = field(Optional(Choice(COMPILE_BACKENDS)), default=None,
                                doc="torch.compile's backend (default inductor)")
    mode: str | None = field(Optional(Choice(COMPILE_MODES)), default=None,
                             doc="inductor's mode (default: inductor's default)")
    dynamic: bool | None = field(Optional(Flag()), default=None,
                                 doc="compile shape-generic code (default false: one specialization per size)")
    fullgraph: bool | None = field(Optional(Flag()), default=None, doc="a graph break is a compile failure")
    strict: bool | None = field(Optional(Flag()), default=None,
                                doc="a segment that cannot be compiled fails the pipeline (default: runs uncompiled, "
                                    "with a warning)")
    options: Mapping[str, object] | None = field(Optional(Table(Text(), Data(), "inductor option names to values")),
                                                 default=None, hash=False, doc="inductor's options")

    def over(self, base: Compile | None) -> Compile:
        """This setting with every unset field taken from ``base``."""
        if base is None:
            return self
        return Compile(**{a.name: getattr(self, a.name) if getattr(self, a.name) is not None else getattr(base, a.name)
                          for a in attrs.fields(Compile)})

    @property
    def inductor_options(self) -> dict[str, object]:
        """The options given, as a plain dict."""
        return dict(self.options or {})


#: What an unset field of ``Compile`` means once nothing else sets it.
COMPILE_DEFAULTS = Compile(enabled=True, backend="inductor", mode="default", dynamic=False, fullgraph=False,
                           strict=False, options={})

_COMPILE = Setting(Compile, "backend", "enabled",
                   "a compile setting: a backend name, true or false, or a mapping of backend, mode, dynamic, "
                   "fullgraph, strict, options")

_NAMES = {what: Items(_NAME, what) for what in ("buffer names", "channel names", "segment names", "JIT kernel names")}
#: What a call by keyword (a segment's, the reference's) passes, by field: the kind and its doc.
_BY_KEYWORD = {
    "inputs": (Table(_KEYWORD, _NAME, "keyword arguments to buffer names"),
               "buffers passed by keyword: argument name to buffer"),
    "objects": (Table(_KEYWORD, _PATH, "keyword arguments to attribute paths on the model"),
                "model attributes passed by keyword (a cache object): argument name to path"),
    "constants": (Table(_KEYWORD, Data(), "keyword arguments to plain values"),
                  "plain values passed by keyword: argument name to value"),
}


def _by_keyword(name: str):
    kind, doc = _BY_KEYWORD[name]
    return field(kind, factory=dict, hash=False, doc=doc)


def _returns(what: str):
    return field(_NAMES["buffer names"], default=(),
                 doc=f"buffers {what} (a tensor, a tuple in order, or a mapping or object by the buffers' names)")


@attrs.frozen
class Segment:
    """A unit of work: a capturable ``graph`` segment or an ``eager`` break.

    ``call`` is an attribute path on the model (``layers.3.pre_attention``).
    ``data_dependent`` marks work whose tensor values decide its path (top-k routing,
    argmax). ``ranks`` limits the segment to some ranks (None: all of them).
    ``after`` adds ordering edges that no buffer expresses. ``kernels`` names the JIT
    kernels (``graphflow.engine.jit`` registry names) the segment launches: the prewarm phase
    warms them before capture, and a cold one inside capture names the segment.
    ``compile`` wraps a graph segment's callable with ``torch.compile`` before warmup
    (``Compile``; ``Plan.compile_of`` says what applies).

    The calling convention (``graphflow.engine.execute.bind``): the callable gets the
    buffers of ``reads`` and then of ``writes`` not read, positionally, except those
    filled from its return value (``returns``) and those the model holds itself
    (adopted); a segment with ``inputs`` gets buffers by keyword only (argument name to
    buffer). ``objects`` pass attributes of the model (a cache object) and
    ``constants`` plain values by keyword. ``inputs`` buffers are
    reads and ``returns`` buffers are writes, listed or not. ``breaks`` names submodules
    (``model.layers.*.self_attn``) whose calls run eagerly between graphs when the
    segment is captured PIECEWISE (``graphflow.engine.model.split``); FULL captures them.
    """

    name: str = field(_NAME)
    kind: SegmentKind = field(Choice.of(SegmentKind))
    call: str = field(_NAME, doc="an attribute path on the model")
    reads: tuple[str, ...] = field(_NAMES["buffer names"], default=())
    writes: tuple[str, ...] = field(_NAMES["buffer names"], default=())
    stream: str | None = field(Optional(_NAME), default=None)
    channels: tuple[str, ...] = field(_NAMES["channel names"], default=())
    family: str = field(_NAME, default="target")
    data_dependent: bool = field(Flag(), default=False)
    device: str | None = field(Optional(_DEVICE), default=None)
    ranks: tuple[int, ...] | None = field(Optional(Items(Integer(minimum=0), "ranks (ints >= 0)")), default=None,
                                          doc="the ranks it runs on; absent: every rank")
    after: tuple[str, ...] = field(_NAMES["segment names"], default=(), doc="segments it must follow")
    kernels: tuple[str, ...] = field(_NAMES["JIT kernel names"], default=(),
                                     doc="the JIT kernels it launches (graphflow.engine.jit), for prewarm")
    inputs: Mapping[str, str] = _by_keyword("inputs")
    objects: Mapping[str, str] = _by_keyword("objects")
    constants: Mapping[str, object] = _by_keyword("constants")
    returns: tuple[str, ...] = _returns("filled from what the callable returns")
    breaks: tuple[str, ...] = field(Items(_PATTERN, "submodule paths"), default=(),
                                    doc="submodules run eagerly between graphs in PIECEWISE capture")
    compile: Compile | None = field(Optional(_COMPILE), default=None,
                                    doc="torch.compile for this graph segment, over the plan's capture.compile")

    def __attrs_post_init__(self) -> None:
        # One spelling per meaning: a buffer passed by keyword is read, one filled from
        # the return value is written, whether or not the lists name it.
        reads = tuple(b for b in dict.fromkeys(self.inputs.values()) if b not in self.reads)
        writes = tuple(b for b in dict.fromkeys(self.returns) if b not in self.writes)
        if reads:
            object.__setattr__(self, "reads", self.reads + reads)
        if writes:
            object.__setattr__(self, "writes", self.writes + writes)

    @property
    def is_graph(self) -> bool:
        return self.kind is SegmentKind.GRAPH

    def runs_on(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


@attrs.frozen
class Reference:
    """The model's own eager step, which verify compares graph replay with.

    A plan that computes the wrong thing in the same way eagerly and replayed passes a
    replay-against-eager check twice; its model's own forward does not. ``call`` is
    called by keyword like a segment (``inputs``, ``objects``, ``constants``) and its
    return value gives the ``returns`` buffers' expected contents; the state buffers
    the step writes are compared too.
    """

    call: str = field(_NAME, doc="an attribute path on the model, e.g. forward")
    inputs: Mapping[str, str] = _by_keyword("inputs")
    objects: Mapping[str, str] = _by_keyword("objects")
    constants: Mapping[str, object] = _by_keyword("constants")
    returns: tuple[str, ...] = _returns("its return value is compared with")


@attrs.frozen
class Family:
    """A group of segments captured together, owning its channels (target, draft...)."""

    name: str = field(_NAME)


@attrs.frozen
class Prewarm:
    """A hook run once per specialization during the prewarm phase, with no communication.

    ``call`` is an attribute path on the model; it is called with the descriptor size
    when ``per_size`` is true, else once with no argument.
    """

    name: str = field(_NAME)
    call: str = field(_NAME, doc="an attribute path on the model")
    per_size: bool = field(Flag(), default=True, doc="call once per descriptor size, else once with no argument")


@attrs.frozen(order=True)
class Descriptor:
    """A capture key. Ordered by mode then size, so sorting is deterministic."""

    mode: Mode = attrs.field(order=lambda m: m.value)
    size: int

    def __str__(self) -> str:
        return f"{self.mode.value}(B={self.size})"


def holders(descriptors: Iterable[Descriptor]) -> list[Descriptor | None]:
    """Batch size -> the descriptor that serves it: the smallest of ``descriptors`` that
    holds it, FULL before PIECEWISE at one size; as long as the largest size plus one
    (index 0 is None)."""
    best: dict[int, Descriptor] = {}
    for descriptor in descriptors:
        if descriptor.size not in best or descriptor.mode is Mode.FULL:
            best[descriptor.size] = descriptor
    sizes = sorted(best)
    served: list[Descriptor | None] = [None] * (sizes[-1] + 1 if sizes else 1)
    at = 0
    for batch in range(1, len(served)):
        at += sizes[at] < batch
        served[batch] = best[sizes[at]]
    return served


@attrs.frozen
class CaptureSettings:
    """How to capture: which modes and sizes, how many warmups, how to verify.

    ``sizes`` are the batch sizes every mode captures; ``mode_sizes`` gives a mode its
    own list instead (vLLM captures FULL decode graphs only up to ``max_num_seqs``
    requests, PIECEWISE graphs up to its largest capture size). Buffers are allocated
    for the largest size of any captured mode. ``compile`` applies ``torch.compile`` to
    every graph segment (``Compile``).
    """

    modes: tuple[Mode, ...] = field(Items(Choice.of(Mode), "modes (PIECEWISE, FULL)"), default=(Mode.PIECEWISE,))
    sizes: tuple[int, ...] = field(_SIZES, default=(1,))
    size_symbol: str = field(_SYMBOL, default="B", doc="the shape symbol the sizes bind")
    #: At least one: without a warmup, lazy allocations and JIT launches happen inside capture.
    warmup_iters: int = field(Integer(minimum=1), default=1)
    atol: float = field(Number(minimum=0.0), default=0.0, key="verify.atol")
    rtol: float = field(Number(minimum=0.0), default=0.0, key="verify.rtol")
    #: Above zero: a zero timeout turns every barrier into a divergence.
    barrier_timeout_s: float = field(Number(minimum=0.0, exclusive=True), default=60.0)
    mode_sizes: Mapping[Mode, tuple[int, ...]] = field(Table(Choice.of(Mode), _SIZES, "modes to their own sizes"),
                                                       factory=dict, hash=False, in_yaml=False)
    compile: Compile | None = field(Optional(_COMPILE), default=None,
                                    doc="torch.compile for every graph segment (a segment's compile overrides it)")
    warmup: Warmup = field(Choice.of(Warmup), default=Warmup.AUTO,
                           doc="which descriptors warm up: each, or auto (those that need it; docs/engine.md)")

    def __attrs_post_init__(self) -> None:
        # One spelling per meaning, so equal settings compare equal: when every captured
        # mode has its own list, ``sizes`` is their union; a list equal to ``sizes`` is
        # no override.
        own = self.mode_sizes
        if own and self.modes and all(m in own for m in self.modes):
            object.__setattr__(self, "sizes", tuple(sorted({s for m in self.modes for s in own[m]})))
        object.__setattr__(self, "mode_sizes", {m: v for m, v in own.items() if v != self.sizes})

    def sizes_for(self, mode: Mode) -> tuple[int, ...]:
        """The sizes ``mode`` captures: its own list, else ``sizes``."""
        return self.mode_sizes.get(mode, self.sizes)

    @property
    def all_sizes(self) -> tuple[int, ...]:
        """Every size some captured mode captures, sorted and de-duplicated."""
        return tuple(sorted({s for mode in self.modes for s in self.sizes_for(mode)}))


@attrs.frozen
class CaptureRegion:
    """One graph to capture per descriptor: a run of segments of one family."""

    mode: Mode
    family: str
    index: int
    segments: tuple[str, ...]

    @property
    def name(self) -> str:
        if len(self.segments) == 1:
            return f"{self.family}:{self.segments[0]}"
        return f"{self.family}:{self.segments[0]}..{self.segments[-1]}"


def _element_key(kind: str, name: str) -> str:
    return f"{kind}:{name}"


@attrs.frozen
class Plan:
    """A whole capture plan. Segment order is execution order.

    ``model`` names the factory (``pkg.mod:function``) that ``graphflow run`` imports and
    calls with ``model_args``; nothing else ever imports code named by a plan.
    ``origins`` maps ``"kind:name"`` (``"segment:L3.pre"``) to where the element was
    declared; it is not part of equality, so a plan equals its YAML round trip.
    """

    name: str = field(_NAME)
    buffers: tuple[Buffer, ...] = field(Elements(Buffer), default=())
    streams: tuple[Stream, ...] = field(Elements(Stream), default=())
    channels: tuple[Channel, ...] = field(Elements(Channel), default=())
    segments: tuple[Segment, ...] = field(Elements(Segment), default=())
    families: tuple[Family, ...] = field(Elements(Family), default=(Family("target"),))
    prewarm: tuple[Prewarm, ...] = field(Elements(Prewarm), default=())
    symbols: Mapping[str, int] = field(Table(_SYMBOL, Integer(minimum=1), "symbols to their values", sort=True),
                                       factory=dict, hash=False, doc="constant shape symbols")
    capture: CaptureSettings = field(Instance(CaptureSettings), factory=CaptureSettings)
    model: str | None = field(Optional(_FACTORY), default=None,
                              doc="the factory graphflow run imports and calls with model_args; loading never "
                                  "imports it")
    model_args: Mapping[str, object] = field(Table(_NAME, Data(), "factory arguments"), factory=dict,
                                             hash=False, doc="keyword arguments of the factory")
    world_size: int = field(Integer(minimum=1), default=1, doc="the number of ranks")
    reference: Reference | None = field(Optional(Instance(Reference, "a reference mapping (call, inputs, returns)")),
                                        default=None, doc="the model's own eager step verify compares replay with")
    origins: Mapping[str, Origin] = attrs.field(factory=dict, eq=False, repr=False)

    # -- lookups -------------------------------------------------------------------
    @functools.cached_property
    def _index(self) -> dict[str, dict]:
        index: dict[str, dict] = {}
        for kind, items in (
            ("buffer", self.buffers),
            ("stream", self.streams),
            ("channel", self.channels),
            ("segment", self.segments),
            ("family", self.families),
            ("prewarm", self.prewarm),
        ):
            table: dict = {}
            for item in items:
                table.setdefault(item.name, item)
            index[kind] = table
        return index

    def buffer(self, name: str) -> Buffer | None:
        return self._index["buffer"].get(name)

    def stream(self, name: str | None) -> Stream | None:
        return self._index["stream"].get(name) if name is not None else None

    def channel(self, name: str) -> Channel | None:
        return self._index["channel"].get(name)

    def segment(self, name: str) -> Segment | None:
        return self._index["segment"].get(name)

    def family(self, name: str) -> Family | None:
        return self._index["family"].get(name)

    def hook(self, name: str) -> Prewarm | None:
        return self._index["prewarm"].get(name)

    def origin(self, kind: str, name: str) -> Origin | None:
        return self.origins.get(_element_key(kind, name))

    def segment_device(self, segment: Segment) -> str | None:
        """A segment's device: declared, else its stream's, else its first known buffer's."""
        if segment.device is not None:
            return segment.device
        stream = self.stream(segment.stream)
        if stream is not None:
            return stream.device
        for name in (*segment.reads, *segment.writes):
            buffer = self.buffer(name)
            if buffer is not None:
                return buffer.device
        return None

    def compile_of(self, segment: Segment) -> Compile | None:
        """The ``torch.compile`` setting a segment runs with, every field set; None when
        it is not compiled (an eager segment, no setting, or ``compile: false``)."""
        if not segment.is_graph:
            return None
        plan_level = self.capture.compile
        if segment.compile is None and plan_level is None:
            return None
        setting = (segment.compile or Compile()).over(plan_level).over(COMPILE_DEFAULTS)
        return setting if setting.enabled else None

    def family_segments(self, family: str) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.family == family)

    # -- descriptors ---------------------------------------------------------------
    def symbol_values(self, size: int) -> dict[str, int]:
        """Every symbol's value for a descriptor of this batch size."""
        values = dict(self.symbols)
        values[self.capture.size_symbol] = size
        return values

    def buffer_values(self, buffer: Buffer, size: int) -> dict[str, int]:
        """The symbol values a descriptor of batch ``size`` sees in ``buffer``: its allocation's,
        with the size symbol at ``size`` (the engine narrows that symbol only)."""
        return {**self.allocation_values(buffer), self.capture.size_symbol: size}

    def descriptors(self) -> tuple[Descriptor, ...]:
        """Every capture key, PIECEWISE before FULL, each mode's sizes largest first."""
        order = [m for m in (Mode.PIECEWISE, Mode.FULL) if m in self.capture.modes]
        return tuple(Descriptor(mode, size) for mode in order
                     for size in sorted(set(self.capture.sizes_for(mode)), reverse=True))

    @property
    def max_size(self) -> int:
        """The largest descriptor size of any captured mode (0 with none)."""
        return max(self.capture.all_sizes, default=0)

    # -- storage and allocation: one answer for the validator, show and the engine ---------
    def alias_chain(self, name: str) -> tuple[str, ...]:
        """``name``, the buffer it aliases, that one's target... up to the buffer owning the storage.

        Stops before a name repeats (an alias cycle, GF204) and at an undeclared name (GF101).
        """
        return alias_chain(name, self.buffer)

    def storage(self, name: str) -> str:
        """The buffer whose storage ``name`` uses: the end of its alias chain."""
        return self.alias_chain(name)[-1]

    def allocation_values(self, buffer: Buffer, largest: int | None = None) -> dict[str, int]:
        """The symbol values ``buffer`` is allocated at, once, before capture.

        Every symbol at its value, the size symbol at the largest descriptor (``largest``,
        default ``max_size``), each raised to the buffer's ``capacity`` where that is
        larger: a capacity is rows the buffer holds, so it never shrinks the allocation
        (a size above it is GF604).
        """
        values = self.symbol_values(self.max_size if largest is None else largest)
        for symbol, cap in buffer.capacity.items():
            values[symbol] = max(values.get(symbol, 0), cap)
        return values

    def allocated_shape(self, buffer: Buffer, largest: int | None = None) -> tuple[int, ...]:
        """The shape ``buffer`` is allocated at (KeyError for a symbol nobody declares: GF106)."""
        values = self.allocation_values(buffer, largest)
        return tuple(eval_dim(dim, values) for dim in buffer.shape)

    def allocated_bytes(self, buffer: Buffer, largest: int | None = None) -> int:
        """The bytes of ``buffer``'s allocation (an alias allocates none: it views its target's)."""
        return math.prod(self.allocated_shape(buffer, largest)) * DTYPE_BYTES[buffer.dtype]

    def static_memory(self, largest: int | None = None) -> dict[str, dict[str, int]]:
        """Bytes allocated before capture, per device then per buffer owning storage.

        What the engine allocates, ``graphflow show`` prints and GF303/GF304 judge.
        Aliases own no storage; a buffer whose shape names an undeclared symbol cannot be
        sized and is left out (GF106 reports it).
        """
        memory: dict[str, dict[str, int]] = {}
        for buffer in self.buffers:
            if buffer.alias_of is None:
                try:
                    size = self.allocated_bytes(buffer, largest)
                except KeyError:
                    continue
                memory.setdefault(buffer.device, {})[buffer.name] = size
        return memory

    def with_modes(self, modes: Sequence[Mode | str]) -> Plan:
        """This plan captured in ``modes`` instead (``graphflow run --modes FULL``).

        A mode keeps its own sizes when the plan gives it some; the sizes of a mode no
        longer captured are dropped, so the variant validates as if written that way.
        """
        chosen = tuple(m if isinstance(m, Mode) else Mode(str(m).strip().upper()) for m in modes)
        capture = self.capture
        own = {m: s for m, s in capture.mode_sizes.items() if m in chosen}
        return attrs.evolve(self, capture=attrs.evolve(capture, modes=chosen, mode_sizes=own))

    # -- derived graph views ---------------------------------------------------------
    def dag(self) -> nx.DiGraph:
        """The dataflow DAG over segment names (see the module docstring): built once per
        plan (validation's rules, ``show`` and the engine all ask) and frozen, so no
        caller can change what the others read."""
        return self._dag

    @functools.cached_property
    def _reports(self) -> dict:
        """The validator's reports of this plan (``graphflow.plan.rules.validate``), by the
        rules left out and the device memory given: a plan never changes, so a run that
        asks twice (the command line before torch loads, the pipeline before capture)
        checks it once."""
        return {}

    @functools.cached_property
    def _dag(self) -> nx.DiGraph:
        return nx.freeze(_build_dag(self))

    def regions(self, mode: Mode) -> tuple[CaptureRegion, ...]:
        """The regions captured as one graph each, for every family, in step order."""
        regions: list[CaptureRegion] = []
        for family in self.families:
            segments = self.family_segments(family.name)
            if mode is Mode.FULL:
                if segments:
                    regions.append(CaptureRegion(mode, family.name, 0, tuple(s.name for s in segments)))
                continue
            for index, run in enumerate(_graph_runs(segments)):
                regions.append(CaptureRegion(mode, family.name, index, run))
        return tuple(regions)

    def step(self, family: str, mode: Mode) -> Iterator[CaptureRegion | Segment]:
        """A family's step as the runtime executes it: regions and eager breaks, in order."""
        regions = {r.segments[0]: r for r in self.regions(mode) if r.family == family}
        skip: set[str] = set()
        for segment in self.family_segments(family):
            if segment.name in skip:
                continue
            region = regions.get(segment.name)
            if region is not None:
                skip.update(region.segments)
                yield region
            else:
                yield segment


def alias_chain(name: str, lookup: Callable[[str], Buffer | None]) -> tuple[str, ...]:
    """``name`` and the ``alias_of`` targets after it, up to a buffer that owns its storage,
    with buffers found by ``lookup`` (a plan's, or the declarations a decorated model
    collects before there is a plan). Stops before a name repeats and at an unknown name."""
    chain = [name]
    buffer = lookup(name)
    while buffer is not None and buffer.alias_of is not None and buffer.alias_of not in chain:
        chain.append(buffer.alias_of)
        buffer = lookup(buffer.alias_of)
    return tuple(chain)


def _graph_runs(segments: tuple[Segment, ...]) -> Iterator[tuple[str, ...]]:
    run: list[str] = []
    for segment in segments:
        if segment.is_graph:
            run.append(segment.name)
        elif run:
            yield tuple(run)
            run = []
    if run:
        yield tuple(run)


def dataflow_edges(segments: Sequence[Segment], *, storage: Callable[[str], str] | None = None,
                   waw: bool = False) -> Iterator[tuple[str, str, str, str | None, int | None]]:
    """The orderings among ``segments`` (in run order): ``(source, target, kind, buffer, version)``.

    A buffer is versioned at each write: a reader follows the writer of the version it
    reads (``raw``), a writer follows the readers of the version it replaces (``war``),
    and ``after`` entries naming one of ``segments`` order too. ``waw`` adds a writer
    following the previous writer: nothing observes that when segments run one by one
    (so ``Plan.dag`` leaves it out), but concurrent streams must keep it.
    ``storage(name)`` maps a buffer to the key conflicts are found by (the engine passes
    the root of its ``alias_of`` chain, so a view conflicts with its target). Edges from
    a segment to itself are left out.
    """
    key = storage or (lambda name: name)
    present = {s.name for s in segments}
    writer: dict[str, tuple[str, int]] = {}  # key -> (segment, version) of its latest write
    readers: dict[str, list[str]] = {}  # key -> readers of its latest version
    for segment in segments:
        target = segment.name
        for name in segment.reads:
            k = key(name)
            if k in writer and writer[k][0] != target:
                yield writer[k][0], target, "raw", name, writer[k][1]
            readers.setdefault(k, []).append(target)
        for name in segment.writes:
            k = key(name)
            version = writer[k][1] + 1 if k in writer else 1
            for reader in readers.get(k, ()):
                if reader != target:
                    yield reader, target, "war", name, version - 1
            if waw and k in writer and writer[k][0] != target:
                yield writer[k][0], target, "waw", name, version - 1
            writer[k] = (target, version)
            readers[k] = []
        for before in segment.after:
            if before in present and before != target:
                yield before, target, "after", None, None


def _build_dag(plan: Plan) -> nx.DiGraph:
    dag = nx.DiGraph()
    for segment in plan.segments:
        dag.add_node(segment.name, segment=segment)
    for source, target, kind, buffer, version in dataflow_edges(plan.segments):
        if dag.has_edge(source, target):
            dag.edges[source, target]["buffers"].append((buffer, version, kind))
        else:
            dag.add_edge(source, target, buffers=[(buffer, version, kind)])
    return dag
