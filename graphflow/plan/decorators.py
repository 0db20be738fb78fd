"""Declaring a capture plan on the model's own code, next to the methods it describes.

A model author marks methods with ``@segment`` (a capturable graph segment) or
``@eager_break`` (work that runs between graphs), declares buffers, streams and
channels as class attributes (``x = buffer(shape=("B", 1024), ...)``), marks the
module's position in its ModuleList (``layer = position()``, which binds ``{layer}``
in every name declared on it or below it) and marks a ``@step`` method that calls the
segments in execution order (one per plan: a PIECEWISE step with eager attention, a
FULL step with static attention). ``plan_from_module(model)`` turns all of it into the
same frozen ``Plan`` the YAML loader builds.

Why the pieces work the way they do:

* Order comes from running the step once, not from definition order: the step is
  called on a *recording view* of the model, on which a decorated method records
  (module path, method, declaration) instead of running. Nothing on the model is
  patched or flagged, so a model being recorded in one thread still runs eagerly in
  another, and the eager path is untouched.
* The decorators hand back the original function (through ``__set_name__``, once the
  class exists), so a decorated method costs exactly what it did undecorated; the
  declaration rides on the function as ``__graphflow__``. Class-level declarations are
  likewise taken off the class into ``__graphflow_declarations__`` (as attrs does with
  ``attr.ib``), so ``self.q`` never silently resolves to a declaration.
* Values that depend on the module's configuration (a hidden size) may be given as a
  callable taking the module: ``shape=lambda m: ("B", m.hidden)``.
* Every misuse is a ``PlanError`` at plan-build time whose element names the module
  and method, e.g. ``layers.3 (DecoderLayer.post_attention)``.

This module imports no torch at import time: ``import graphflow`` stays torch-free.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from graphflow.plan import templates
from graphflow.errors import FieldError, FieldTypeError, FieldValueError, PlanError
from graphflow.plan.model import (
    Buffer,
    BufferRole,
    CaptureSettings,
    Channel,
    Family,
    Mode,
    Origin,
    Plan,
    Prewarm,
    Reference,
    Segment,
    SegmentKind,
    Stream,
    WarmupPolicy,
    alias_chain,
)

__all__ = [
    "buffer",
    "channel",
    "eager_break",
    "normalized",
    "plan_from_module",
    "position",
    "prewarm",
    "segment",
    "step",
    "stream",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Where a class keeps the declarations taken off it (its own, not inherited).
_REGISTRY = "__graphflow_declarations__"
#: The attribute a decorated function carries its declarations in.
_MARK = "__graphflow__"


# -- declarations -------------------------------------------------------------------------
def _origin(file: str, line: int) -> Origin:
    """Files under the working directory are named relative to it, as plan files are."""
    relative = os.path.relpath(file)
    return Origin(file if relative.startswith("..") else relative, line)


def _caller_origin(depth: int = 2) -> Origin:
    frame = sys._getframe(depth)
    return _origin(frame.f_code.co_filename, frame.f_lineno)


class _ClassLevel:
    """Taken off the class once it exists and kept in its registry, as attrs does with
    ``attr.ib``: a declaration never shadows a submodule or attribute of the same name."""

    __slots__ = ()

    def __set_name__(self, owner: type, attr: str) -> None:
        if _REGISTRY not in owner.__dict__:
            setattr(owner, _REGISTRY, {})
        owner.__dict__[_REGISTRY][attr] = self
        delattr(owner, attr)


@attrs.frozen
class BufferDecl(_ClassLevel):
    """A class-level ``buffer(...)``; any field may be a callable taking the module."""

    name: Any
    shape: Any
    dtype: Any
    device: Any
    role: Any = BufferRole.INTERNAL
    capacity: Any = attrs.field(factory=dict)
    alias_of: Any = None
    values: Any = None
    adopt: Any = None
    pad: Any = None
    origin: Origin | None = attrs.field(default=None, eq=False, repr=False)

    element = "buffer"

    def build(self, name: str, resolve: Callable[[Any], Any], expand: Callable[[str], str]) -> Buffer:
        alias = resolve(self.alias_of)
        adopt = resolve(self.adopt)
        shape = resolve(self.shape)
        return Buffer(name=name, shape=[resolve(dim) for dim in shape] if isinstance(shape, (list, tuple)) else shape,
                      dtype=resolve(self.dtype), device=resolve(self.device), role=resolve(self.role),
                      capacity=resolve(self.capacity) or {}, alias_of=None if alias is None else expand(alias),
                      values=resolve(self.values), adopt=None if adopt is None else expand(adopt),
                      pad=resolve(self.pad))


@attrs.frozen
class StreamDecl(_ClassLevel):
    """A class-level ``stream(...)``."""

    name: Any
    device: Any
    origin: Origin | None = attrs.field(default=None, eq=False, repr=False)

    element = "stream"

    def build(self, name: str, resolve: Callable[[Any], Any], expand: Callable[[str], str]) -> Stream:
        return Stream(name=name, device=resolve(self.device))


@attrs.frozen
class ChannelDecl(_ClassLevel):
    """A class-level ``channel(...)``."""

    name: Any
    kind: Any
    group: Any
    id: Any
    family: Any = "target"
    warmup: Any = WarmupPolicy.REAL
    prewarm: Any = None
    jit: Any = False
    origin: Origin | None = attrs.field(default=None, eq=False, repr=False)

    element = "channel"

    def build(self, name: str, resolve: Callable[[Any], Any], expand: Callable[[str], str]) -> Channel:
        hook = resolve(self.prewarm)
        return Channel(name=name, kind=resolve(self.kind), group=expand(resolve(self.group)), id=resolve(self.id),
                       family=expand(resolve(self.family)), warmup=resolve(self.warmup),
                       prewarm=None if hook is None else expand(hook), jit=resolve(self.jit))


@attrs.frozen
class PositionDecl(_ClassLevel):
    """A class-level ``position()``: binds the module's index in its container."""

    name: str | None
    origin: Origin | None = attrs.field(default=None, eq=False, repr=False)

    element = "position"


@attrs.frozen
class SegmentDecl:
    """What ``@segment`` / ``@eager_break`` declare about a method (names are templates)."""

    kind: SegmentKind
    name: str | None = None
    reads: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    writes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    stream: str | None = None
    channels: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    family: str = "target"
    data_dependent: bool = False
    device: str | None = None
    ranks: tuple[int, ...] | None = None
    after: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    kernels: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    inputs: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    objects: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    constants: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    returns: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    breaks: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    compile: Any = None

    @property
    def decorator(self) -> str:
        return "@graphflow.segment" if self.kind is SegmentKind.GRAPH else "@graphflow.eager_break"


@attrs.frozen
class StepDecl:
    """``@step``: the method whose calls give segment order, and plan-wide defaults.

    A field left ``None`` falls back to ``plan_from_module``'s argument, then to the
    ``Plan`` default; any field may be a callable taking the module.
    """

    name: Any = None
    sizes: Any = None
    modes: Any = None
    size_symbol: Any = None
    symbols: Any = None
    warmup_iters: Any = None
    atol: Any = None
    rtol: Any = None
    barrier_timeout_s: Any = None
    families: Any = None
    world_size: Any = None
    reference: Any = None
    compile: Any = None

    decorator = "@graphflow.step"


@attrs.frozen
class PrewarmDecl:
    """``@prewarm``: a hook run once per specialization, with no communication."""

    name: str | None = None
    per_size: bool = True

    decorator = "@graphflow.prewarm"


_ClassDecl = BufferDecl | StreamDecl | ChannelDecl | PositionDecl
_MethodDecl = SegmentDecl | StepDecl | PrewarmDecl


def buffer(name: str | None = None, *, shape, dtype, device, role="internal", capacity=None, alias_of=None,
           values=None, adopt=None, pad=None) -> BufferDecl:
    """Declare a static buffer; ``name`` defaults to the attribute's and may use ``{layer}``.

    ``adopt`` names the model's tensor this buffer is (a path from the root model, e.g.
    ``"cache.layers.{layer}.keys"``); ``pad`` what its padded rows hold (a number for an
    input, ``"keep"`` for batch-indexed state).
    """
    return BufferDecl(name, shape, dtype, device, role, capacity or {}, alias_of, values, adopt, pad,
                      _caller_origin())


def stream(name: str | None = None, *, device) -> StreamDecl:
    """Declare an explicit capture stream on one device."""
    return StreamDecl(name, device, _caller_origin())


def channel(name: str | None = None, *, kind, group, id, family="target", warmup="real", prewarm=None,
            jit=False) -> ChannelDecl:
    """Declare a communication channel owned by ``family``, with its semantic ``id``."""
    return ChannelDecl(name, kind, group, id, family, warmup, prewarm, jit, _caller_origin())


def position(name: str | None = None) -> PositionDecl:
    """Bind this module's index in its ModuleList/Sequential as ``{name}`` (default: the attribute's).

    The binding holds for every declaration on the module and on its submodules.
    """
    return PositionDecl(name, _caller_origin())


class _Declared:
    """A decorated function until its class exists; then the function itself again.

    ``__set_name__`` puts the plain function back on an ``nn.Module`` subclass with
    its declarations attached, so the eager path costs nothing. Anywhere else (a free
    function, a staticmethod, a method of a non-module class, under another
    decorator) this object stays, runs the function unchanged, and turns into a
    ``PlanError`` if the step reaches it while recording.
    """

    __slots__ = ("fn", "decls", "owner", "attr")

    def __init__(self, fn: Callable[..., Any], decls: tuple[_MethodDecl, ...]):
        self.fn = fn
        self.decls = decls
        self.owner: type | None = None
        self.attr: str | None = None

    def __set_name__(self, owner: type, attr: str) -> None:
        self.owner, self.attr = owner, attr
        if _is_module_class(owner) and isinstance(self.fn, types.FunctionType):
            self.fn.__graphflow__ = self.decls
            setattr(owner, attr, self.fn)

    def __get__(self, instance, owner=None):
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args, **kwargs):
        if any(isinstance(arg, (_Placeholder, _ModuleView)) for arg in (*args, *kwargs.values())):
            raise PlanError(f"{self.decls[0].decorator} decorates {self.describe()}, which the step reached; "
                            "only plain methods of nn.Module subclasses in the model tree are recorded — "
                            "decorate a module method, with the graphflow decorator outermost",
                            element=self.qualname())
        return self.fn(*args, **kwargs)

    def qualname(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def describe(self) -> str:
        if self.owner is None:
            return f"{self.qualname()}, which is not a method"
        if not _is_module_class(self.owner):
            return f"{self.qualname()}, a method of {self.owner.__name__}, which is not an nn.Module"
        return f"{self.qualname()}, a {type(self.fn).__name__} rather than a plain function"


def _decorate(decl: _MethodDecl) -> Callable[[F], F]:
    def apply(fn):
        if isinstance(fn, _Declared):
            return _Declared(fn.fn, (*fn.decls, decl))
        return _Declared(fn, (decl,))

    return apply


def segment(name: str | None = None, *, reads: Iterable[str] = (), writes: Iterable[str] = (),
            stream: str | None = None, channels: Iterable[str] = (), family: str = "target",
            data_dependent: bool = False, device: str | None = None, ranks: Iterable[int] | None = None,
            after: Iterable[str] = (), kernels: Iterable[str] = (), inputs: Mapping[str, str] | None = None,
            objects: Mapping[str, str] | None = None, constants: Mapping[str, Any] | None = None,
            returns: Iterable[str] = (), breaks: Iterable[str] = (), compile=None) -> Callable[[F], F]:
    """Declare the method a capturable graph segment.

    The engine calls it as ``fn(*reads, *writes_not_in_reads)`` with buffer views, less
    the buffers it fills from the return value (``returns``) or the model holds
    (adopted); with ``inputs`` (argument to buffer) it passes buffers by keyword only.
    ``objects`` (argument to a path on the root model) and ``constants`` go by keyword. ``breaks`` names
    submodules (paths from the root model, ``*`` for any part) run eagerly between
    graphs in PIECEWISE capture. ``name`` (default: the call path) and every buffer,
    stream, channel and segment name may use the module's positions, e.g.
    ``"L{layer}.pre"``, ``"x{layer+1}"``. ``kernels`` names the JIT kernels the method
    launches (docs/jit.md).
    """
    _check_called("segment", name)
    return _decorate(SegmentDecl(SegmentKind.GRAPH, name, reads, writes, stream, channels, family,
                                 data_dependent, device, None if ranks is None else tuple(ranks), after, kernels,
                                 inputs or {}, objects or {}, constants or {}, returns, breaks, compile))


def eager_break(name: str | None = None, *, reads: Iterable[str] = (), writes: Iterable[str] = (),
                stream: str | None = None, channels: Iterable[str] = (), family: str = "target",
                data_dependent: bool = False, device: str | None = None, ranks: Iterable[int] | None = None,
                after: Iterable[str] = (), kernels: Iterable[str] = (), inputs: Mapping[str, str] | None = None,
                objects: Mapping[str, str] | None = None, constants: Mapping[str, Any] | None = None,
                returns: Iterable[str] = ()) -> Callable[[F], F]:
    """Declare the method an eager break: it runs between graphs, never inside one
    (same calling convention as ``segment``)."""
    _check_called("eager_break", name)
    return _decorate(SegmentDecl(SegmentKind.EAGER, name, reads, writes, stream, channels, family,
                                 data_dependent, device, None if ranks is None else tuple(ranks), after, kernels,
                                 inputs or {}, objects or {}, constants or {}, returns))


def _check_called(decorator: str, name) -> None:
    """``@segment`` without its call would swallow the method silently: refuse it at once."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"@graphflow.{decorator} takes the segment's name (a string) and its reads and writes: "
                        f"write @graphflow.{decorator}(\"name\", reads=[...], writes=[...]), got {name!r}")


def step(fn: F | None = None, *, name=None, sizes=None, modes=None, size_symbol=None, symbols=None,
         warmup_iters=None, atol=None, rtol=None, barrier_timeout_s=None, families=None,
         world_size=None, reference=None, compile=None):
    """Mark the method that calls the segments in order (``@step`` or ``@step(sizes=...)``).

    It also serves as the model's eager step. While recording, each parameter without
    a default receives a placeholder (indexable, attribute-able), decorated methods
    return one, and nothing runs: a step may only route arguments to decorated
    methods and loop over submodules. ``reference`` is the model's own eager step that
    verify compares replay with: a ``graphflow.Reference`` or its fields as a mapping
    (``{"call": "forward", "inputs": {"x": "x"}, "returns": ["y"]}``). ``compile`` is the
    plan's ``capture.compile``: ``torch.compile`` for every graph segment (docs/compile.md).
    """
    decl = StepDecl(name, sizes, modes, size_symbol, symbols, warmup_iters, atol, rtol, barrier_timeout_s,
                    families, world_size, reference, compile)
    return _decorate(decl)(fn) if fn is not None else _decorate(decl)


def prewarm(fn: F | None = None, *, name: str | None = None, per_size: bool = True):
    """Mark a prewarm hook (``@prewarm`` or ``@prewarm(name=..., per_size=False)``)."""
    decl = PrewarmDecl(name, per_size)
    return _decorate(decl)(fn) if fn is not None else _decorate(decl)


def _is_module_class(owner: type) -> bool:
    nn = sys.modules.get("torch.nn")
    return nn is not None and isinstance(owner, type) and issubclass(owner, nn.Module)


# -- templates -------------------------------------------------------------------------------


def _expand(text: str, env: Mapping[str, int], fail: Callable[[str], PlanError]) -> str:
    """Expand the module's positions in ``text`` with the YAML loader's grammar (``graphflow.plan.templates``)."""
    if not isinstance(text, str):
        raise fail(f"expected a name (a string), got {type(text).__name__} {text!r}")

    def unbound(name: str) -> str:
        bound = ", ".join(sorted(env)) or "none"
        return (f"{text!r} uses {{{name}}}, but neither this module nor a parent declares "
                f"{name} = graphflow.position() (bound here: {bound})")

    try:
        return templates.expand(text, env, unbound)
    except templates.TemplateError as exc:
        raise fail(str(exc)) from exc


# -- the module tree ---------------------------------------------------------------------------
@attrs.frozen
class _ClassInfo:
    """A module class's declarations, merged over its MRO (the most derived wins)."""

    declarations: Mapping[str, _ClassDecl]
    methods: Mapping[str, tuple[Callable[..., Any], tuple[_MethodDecl, ...]]]
    misplaced: Mapping[str, tuple[_Declared, str]]  # attr -> (declaration, what is wrong)

    @classmethod
    def of(cls, klass: type) -> _ClassInfo:
        declarations: dict[str, _ClassDecl] = {}
        names: dict[str, None] = {}
        for base in reversed(klass.__mro__):
            declarations.update(base.__dict__.get(_REGISTRY, {}))
            names.update(dict.fromkeys(base.__dict__))
        methods, misplaced = {}, {}
        for attr in names:
            value = inspect.getattr_static(klass, attr)
            if isinstance(value, _Declared):
                misplaced[attr] = (value, value.describe())
            elif isinstance(value, types.FunctionType) and _MARK in value.__dict__:
                methods[attr] = (value, value.__dict__[_MARK])
            elif isinstance(value, types.FunctionType):
                inner = inspect.unwrap(value, stop=lambda f: isinstance(f, _Declared))
                if isinstance(inner, _Declared):
                    misplaced[attr] = (inner, f"{inner.qualname()} under another decorator")
            elif isinstance(value, (staticmethod, classmethod)) and isinstance(value.__func__, _Declared):
                misplaced[attr] = (value.__func__, f"a {type(value).__name__} {value.__func__.qualname()}")
        return cls(declarations, methods, misplaced)


@attrs.frozen(eq=False)
class _Site:
    """One module of the tree: its path, the positions bound at it, its class's declarations."""

    path: str
    module: Any
    env: Mapping[str, int]
    info: _ClassInfo

    def element(self, attr: str) -> str:
        qual = f"{type(self.module).__name__}.{attr}"
        return f"{self.path} ({qual})" if self.path else qual

    def call(self, method: str) -> str:
        return f"{self.path}.{method}" if self.path else method

    def error(self, attr: str, message: str, origin: Origin | None = None) -> PlanError:
        file, line = (origin.file, origin.line) if origin is not None else (None, None)
        return PlanError(message, file=file, line=line, element=self.element(attr))

    def resolve(self, value: Any) -> Any:
        return value(self.module) if callable(value) and not isinstance(value, type) else value

    def expand(self, attr: str, text: str, origin: Origin | None = None) -> str:
        return _expand(text, self.env, lambda message: self.error(attr, message, origin))


def _method_origin(fn: Callable[..., Any]) -> Origin | None:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return _origin(code.co_filename, code.co_firstlineno) if code is not None else None


def _sites(model) -> list[_Site]:
    """Every module in tree order, with the positions bound at it."""
    infos: dict[type, _ClassInfo] = {}
    sites: dict[str, _Site] = {}
    for path, module in model.named_modules():
        klass = type(module)
        if klass not in infos:
            infos[klass] = _ClassInfo.of(klass)
        info = infos[klass]
        parent, _, last = path.rpartition(".")
        inherited = sites[parent].env if path else {}
        env = dict(inherited)
        for attr, decl in info.declarations.items():
            if not isinstance(decl, PositionDecl):
                continue
            var = decl.name or attr
            if not last.isdigit():
                raise _Site(path, module, inherited, info).error(
                    attr, f"declares position {var!r}, but it is not an item of a ModuleList or Sequential "
                          f"(its path is {path or 'the root'!r})", decl.origin)
            if var in env:
                raise _Site(path, module, inherited, info).error(
                    attr, f"position {var!r} is already bound to {env[var]} by a parent module: give one of "
                          "them another name", decl.origin)
            env[var] = int(last)
        sites[path] = _Site(path, module, env, info)
    return list(sites.values())


# -- recording -----------------------------------------------------------------------------------
class _Placeholder:
    """What the step's arguments and recorded calls are while recording: indexing or
    attribute access gives the placeholder again, so ``bufs["x"]`` and ``out.logits``
    work; any arithmetic fails, which is the point (the step must not compute)."""

    __slots__ = ()

    def __getitem__(self, key):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __repr__(self) -> str:
        return "<graphflow recording placeholder>"


_PLACEHOLDER = _Placeholder()


@attrs.frozen
class _Call:
    site: _Site
    method: str
    fn: Callable[..., Any]
    decl: SegmentDecl


class _Recorder:
    """Collects the decorated calls the step makes, in order."""

    def __init__(self, sites: list[_Site]):
        self.by_id = {id(site.module): site for site in sites}
        self.calls: list[_Call] = []

    def site(self, module) -> _Site | None:
        return self.by_id.get(id(module))

    def view(self, value):
        nn = sys.modules["torch.nn"]
        return _ModuleView(value, self) if isinstance(value, nn.Module) else value

    def record(self, module, method: str, fn, decls: tuple[_MethodDecl, ...]):
        site = self.site(module)
        if site is None:
            raise PlanError("the step reached a decorated method of a module that is not registered in the "
                            "model tree: assign it as a module attribute or put it in a ModuleList",
                            element=f"{type(module).__name__}.{method}")
        segments = [d for d in decls if isinstance(d, SegmentDecl)]
        if not segments:
            raise site.error(method, f"the step calls a method marked {decls[0].decorator}: a step may call "
                                     "only @graphflow.segment and @graphflow.eager_break methods (and plain "
                                     "methods that call them)", _method_origin(fn))
        self.calls.append(_Call(site, method, fn, segments[0]))
        return _PLACEHOLDER


class _ModuleView:
    """A module as the step sees it while recording.

    Decorated methods record; other methods of the class run with the view as
    ``self`` (so their calls are recorded too); submodules come back as views; any
    other attribute (config, parameters) is the module's own.
    """

    __slots__ = ("_gf_module", "_gf_recorder")

    def __init__(self, module, recorder: _Recorder):
        object.__setattr__(self, "_gf_module", module)
        object.__setattr__(self, "_gf_recorder", recorder)

    def __getattr__(self, name: str):
        module, recorder = self._gf_module, self._gf_recorder
        static = inspect.getattr_static(module, name, None)
        if isinstance(static, types.FunctionType) and name not in getattr(module, "__dict__", {}):
            decls = static.__dict__.get(_MARK)
            if decls is not None:
                return lambda *args, **kwargs: recorder.record(module, name, static, decls)
            return types.MethodType(static, self)
        if isinstance(static, _Declared):
            raise PlanError(f"{static.decls[0].decorator} decorates {static.describe()}; decorate a plain "
                            "method, with the graphflow decorator outermost", element=static.qualname())
        if name == "_modules":
            return {key: recorder.view(child) for key, child in module._modules.items()}
        return recorder.view(getattr(module, name))

    def __call__(self, *args, **kwargs):
        return self.__getattr__("forward")(*args, **kwargs)

    def __iter__(self):
        return (self._gf_recorder.view(item) for item in iter(self._gf_module))

    def __len__(self) -> int:
        return len(self._gf_module)

    def __getitem__(self, key):
        return self._gf_recorder.view(self._gf_module[key])

    def __repr__(self) -> str:
        return f"<recording view of {type(self._gf_module).__name__}>"


# -- building the plan ----------------------------------------------------------------------------
@attrs.define
class _Table:
    """Declared elements of one kind, by name, remembering who declared each first."""

    kind: str
    items: dict[str, Any] = attrs.field(factory=dict)
    sources: dict[str, tuple[_Site, str, Origin | None]] = attrs.field(factory=dict)

    def add(self, element, site: _Site, attr: str, origin: Origin | None) -> None:
        first = self.items.get(element.name)
        if first is None:
            self.items[element.name] = element
            self.sources[element.name] = (site, attr, origin)
            return
        if first != element:
            other_site, other_attr, _ = self.sources[element.name]
            differences = "; ".join(f"{f.name} {getattr(first, f.name)!r} there, {getattr(element, f.name)!r} here"
                                    for f in attrs.fields(type(element))
                                    if getattr(first, f.name) != getattr(element, f.name))
            raise site.error(attr, f"{self.kind} {element.name!r} is declared differently by "
                                   f"{other_site.element(other_attr)} ({differences}) — declare it once, or make "
                                   "the declarations agree", origin)

    def error(self, name: str, message: str) -> PlanError:
        site, attr, origin = self.sources[name]
        return site.error(attr, message, origin)


def _declarations(sites: list[_Site]) -> dict[str, _Table]:
    """Every buffer, stream, channel and prewarm hook the tree declares, expanded, conflicts checked."""
    tables = {kind: _Table(kind) for kind in ("buffer", "stream", "channel", "prewarm")}
    for site in sites:
        for attr, (declared, what) in site.info.misplaced.items():
            raise site.error(attr, f"{declared.decls[0].decorator} decorates {what}; only plain methods are "
                                   "recorded: decorate a plain method, with the graphflow decorator outermost",
                                   _method_origin(declared.fn))
        for attr, decl in site.info.declarations.items():
            if isinstance(decl, PositionDecl):
                continue
            name = site.expand(attr, site.resolve(decl.name) or attr, decl.origin)
            try:
                element = decl.build(name, site.resolve, lambda text: site.expand(attr, text, decl.origin))
            except (TypeError, ValueError) as exc:
                raise site.error(attr, f"bad {decl.element} declaration: {exc}", decl.origin) from exc
            tables[decl.element].add(element, site, attr, decl.origin)
        for attr, (fn, decls) in site.info.methods.items():
            if len(decls) > 1:
                raise site.error(attr, "declared twice (" + " and ".join(d.decorator for d in decls) +
                                 "): keep one declaration per method", _method_origin(fn))
            decl = decls[0]
            if isinstance(decl, PrewarmDecl):
                name = site.expand(attr, decl.name, _method_origin(fn)) if decl.name else site.call(attr)
                tables["prewarm"].add(Prewarm(name, site.call(attr), decl.per_size), site, attr, _method_origin(fn))
    return tables


def _check_arity(call: _Call, segment: Segment, origin: Origin | None, adopted: set[str]) -> None:
    """The engine calls ``fn(*reads, *writes_not_in_reads)`` (less keyword, returned and
    adopted buffers) plus the keyword arguments: say so now if that cannot bind."""
    skip = {*segment.returns, *adopted}
    names = [] if segment.inputs else [n for n in dict.fromkeys((*segment.reads, *segment.writes)) if n not in skip]
    keywords = {**dict.fromkeys(segment.inputs), **dict.fromkeys(segment.objects), **dict.fromkeys(segment.constants)}
    try:
        inspect.signature(call.fn).bind(None, *([None] * len(names)), **keywords)
    except TypeError as exc:
        given = ", ".join(names) or "none"
        by_keyword = f" and keywords {', '.join(keywords)}" if keywords else ""
        raise call.site.error(call.method, f"the engine calls it with {len(names)} buffer arguments "
                                           f"(fn(*reads, *writes_not_in_reads): {given}){by_keyword}, which its "
                                           f"signature cannot take: {exc}", origin) from exc


def _check_references(call: _Call, built: Segment, tables: Mapping[str, _Table], origin: Origin | None) -> None:
    """Names a segment uses must be declared by some module: say which, and how to declare it."""
    wanted = [("buffer", n, "reads" if n in built.reads else "writes") for n in (*built.reads, *built.writes)]
    wanted += [("stream", built.stream, "runs on")] if built.stream is not None else []
    wanted += [("channel", n, "uses") for n in built.channels]
    for kind, name, verb in wanted:
        if name not in tables[kind].items:
            raise call.site.error(call.method, f"{verb} {kind} {name!r}, which no module declares — add "
                                               f"{name} = graphflow.{kind}(...) to a module class", origin)


def _segment(call: _Call) -> Segment:
    site, decl, origin = call.site, call.decl, _method_origin(call.fn)

    def expand(text: str) -> str:
        return site.expand(call.method, text, origin)

    try:
        return Segment(
            name=expand(decl.name) if decl.name is not None else site.call(call.method),
            kind=decl.kind,
            call=site.call(call.method),
            reads=[expand(n) for n in decl.reads],
            writes=[expand(n) for n in decl.writes],
            stream=None if decl.stream is None else expand(decl.stream),
            channels=[expand(n) for n in decl.channels],
            family=expand(decl.family),
            data_dependent=decl.data_dependent,
            device=None if decl.device is None else expand(decl.device),
            ranks=decl.ranks,
            after=[expand(n) for n in decl.after],
            kernels=[expand(n) for n in decl.kernels],
            inputs={k: expand(v) for k, v in decl.inputs.items()},
            objects={k: expand(v) for k, v in decl.objects.items()},
            constants=dict(decl.constants),
            returns=[expand(n) for n in decl.returns],
            breaks=[expand(n) for n in decl.breaks],
            compile=site.resolve(decl.compile),
        )
    except FieldError as exc:
        raise site.error(call.method, f"bad {decl.decorator} declaration: {exc}", origin) from exc


def _segments(calls: list[_Call], tables: Mapping[str, _Table]) -> list[Segment]:
    segments: list[Segment] = []
    seen: dict[str, _Call] = {}
    for call in calls:
        origin = _method_origin(call.fn)
        built = _segment(call)
        if built.name in seen:
            other = seen[built.name]
            raise call.site.error(call.method, f"segment {built.name!r} is also declared by "
                                               f"{other.site.element(other.method)}: segment names must be "
                                               "unique — use the module's position, e.g. 'L{layer}.pre'", origin)
        _check_references(call, built, tables, origin)
        _check_arity(call, built, origin, {n for n, b in tables["buffer"].items.items() if b.adopt is not None})
        seen[built.name] = call
        segments.append(built)
    return segments


def _steps(root: _Site) -> dict[str, tuple[Callable[..., Any], StepDecl]]:
    steps = {attr: (fn, decls[0]) for attr, (fn, decls) in root.info.methods.items()
             if isinstance(decls[0], StepDecl)}
    if not steps:
        raise PlanError("declares no @graphflow.step method: mark the method that calls the segments in "
                        "order", element=type(root.module).__name__)
    return steps


def _choose(root: _Site, steps: Mapping[str, Any], chosen: str | None) -> str:
    names = ", ".join(steps)
    if chosen is None:
        if len(steps) > 1:
            raise PlanError(f"declares {len(steps)} @graphflow.step methods ({names}): choose one with "
                            "step= (graphflow CLI: --step)", element=type(root.module).__name__)
        return next(iter(steps))
    if chosen not in steps:
        raise PlanError(f"has no @graphflow.step method {chosen!r}; its steps: {names}",
                        element=type(root.module).__name__)
    return chosen


def _record(root: _Site, sites: list[_Site], attr: str, fn: Callable[..., Any]) -> list[_Call]:
    """Run one step on a recording view of the model: its decorated calls, in order."""
    recorder = _Recorder(sites)
    params = list(inspect.signature(fn).parameters.values())[1:]
    args = [_PLACEHOLDER for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: _PLACEHOLDER for p in params if p.default is p.empty and p.kind is p.KEYWORD_ONLY}
    try:
        fn(_ModuleView(root.module, recorder), *args, **kwargs)
    except PlanError:
        raise
    except Exception as exc:
        raise root.error(attr, f"the step raised {type(exc).__name__}: {exc} — while recording, arguments and "
                               "decorated calls are placeholders, so a step may only pass them on to decorated "
                               "methods and loop over submodules", _method_origin(fn)) from exc
    return recorder.calls


def _check_all_reached(sites: list[_Site], calls: Iterable[_Call]) -> None:
    """A decorated method no step reaches is a mistake YAML cannot make: say so.

    Declarations no step uses (a buffer, stream or channel) are kept in the plan
    instead, for the validator to warn about exactly as it does for a YAML plan.
    """
    reached = {(id(call.site.module), call.method) for call in calls}
    for site in sites:
        for attr, (fn, decls) in site.info.methods.items():
            if isinstance(decls[0], SegmentDecl) and (id(site.module), attr) not in reached:
                raise site.error(attr, f"declared with {decls[0].decorator} but never reached by a step: call it "
                                       f"from a @graphflow.step method of {type(sites[0].module).__name__}, or "
                                       "remove the decorator", _method_origin(fn))


def _used(tables: Mapping[str, _Table], segments: list[Segment]) -> dict[str, set[str]]:
    """The names segments use, with the buffers those alias and the hooks their channels name."""
    lookup = tables["buffer"].items.get
    buffers = {name for s in segments for n in (*s.reads, *s.writes) for name in alias_chain(n, lookup)}
    channels = {n for s in segments for n in s.channels}
    named_hooks = {c.prewarm for c in tables["channel"].items.values() if c.prewarm is not None}
    hooks = {c.prewarm for name, c in tables["channel"].items.items() if name in channels}
    hooks |= {name for name in tables["prewarm"].items if name not in named_hooks}
    return {"buffer": buffers, "stream": {s.stream for s in segments if s.stream is not None},
            "channel": channels, "prewarm": hooks}


def _first(*values):
    return next((v for v in values if v is not None), None)


def plan_from_module(model, *, step: str | None = None, factory: str | None = None,
                     model_args: Mapping[str, Any] | None = None, name: str | None = None,
                     sizes: Iterable[int] | None = None, modes: Iterable[Mode | str] | None = None,
                     size_symbol: str | None = None, symbols: Mapping[str, int] | None = None,
                     warmup_iters: int | None = None, atol: float | None = None, rtol: float | None = None,
                     barrier_timeout_s: float | None = None, families: Iterable[str] | None = None,
                     world_size: int | None = None, compile=None) -> Plan:
    """The plan a decorated model declares: walk its tree, record its steps, check, build.

    ``step`` names the ``@step`` method whose plan to build (needed when the model has
    several, e.g. a PIECEWISE and a FULL step). The plan holds that step's segments in
    call order and the declared buffers, streams and channels they use. Every step is
    recorded and checked, so a method no step reaches is an error. ``factory``
    (``pkg.mod:function``) and ``model_args`` say how ``graphflow run`` rebuilds the
    model. Other arguments override the ``@step``'s defaults. Raises ``PlanError``
    naming the module and method for any misuse.
    """
    nn = _torch_nn()
    if not isinstance(model, nn.Module):
        raise PlanError(f"expected an nn.Module, got {type(model).__name__}", element="plan_from_module")
    sites = _sites(model)
    root = sites[0]
    tables = _declarations(sites)
    steps = _steps(root)
    chosen = _choose(root, steps, step)
    recorded = {attr: _record(root, sites, attr, fn) for attr, (fn, _) in steps.items()}
    built = {attr: _segments(calls, tables) for attr, calls in recorded.items()}
    _check_all_reached(sites, (c for calls in recorded.values() for c in calls))
    segments = built[chosen]
    used = _used(tables, segments)
    anywhere = _used(tables, [s for segments in built.values() for s in segments])
    # What this step uses, and what no step uses: the validator warns about the latter
    # (GF205, GF404, GF506) as it does for a YAML plan; another step's elements stay out.
    kept = {kind: [e for n, e in table.items.items() if n in used[kind] or n not in anywhere[kind]]
            for kind, table in tables.items()}
    origins = {f"{kind}:{e.name}": tables[kind].sources[e.name][2] for kind, elements in kept.items()
               for e in elements if tables[kind].sources[e.name][2] is not None}
    origins.update({f"segment:{s.name}": o for s, c in zip(segments, recorded[chosen])
                    if (o := _method_origin(c.fn)) is not None})

    step_fn, step_decl = steps[chosen]

    def setting(value, field):
        return _first(value, root.resolve(getattr(step_decl, field)))

    defaults = CaptureSettings()
    named = [c.family for c in kept["channel"]] + [s.family for s in segments]
    try:
        capture = CaptureSettings(
            modes=setting(modes, "modes") or defaults.modes,
            sizes=setting(sizes, "sizes") or defaults.sizes,
            size_symbol=_first(setting(size_symbol, "size_symbol"), defaults.size_symbol),
            warmup_iters=_first(setting(warmup_iters, "warmup_iters"), defaults.warmup_iters),
            atol=_first(setting(atol, "atol"), defaults.atol),
            rtol=_first(setting(rtol, "rtol"), defaults.rtol),
            barrier_timeout_s=_first(setting(barrier_timeout_s, "barrier_timeout_s"), defaults.barrier_timeout_s),
            compile=setting(compile, "compile"),
        )
        return Plan(
            name=_first(setting(name, "name"), type(model).__name__),
            buffers=kept["buffer"],
            streams=kept["stream"],
            channels=kept["channel"],
            segments=segments,
            families=[Family(f) for f in setting(families, "families") or list(dict.fromkeys(named)) or ["target"]],
            prewarm=kept["prewarm"],
            symbols=setting(symbols, "symbols") or {},
            capture=capture,
            model=factory,
            model_args=dict(model_args or {}),
            world_size=_first(setting(world_size, "world_size"), 1),
            reference=_reference(root.resolve(step_decl.reference)),
            origins=origins,
        )
    except FieldError as exc:
        raise root.error(chosen, f"bad {step_decl.decorator} settings: {exc}", _method_origin(step_fn)) from exc


def _reference(value: Reference | Mapping[str, Any] | None) -> Reference | None:
    if value is None or isinstance(value, Reference):
        return value
    if not isinstance(value, Mapping):
        raise FieldTypeError("reference", "a graphflow.Reference or a mapping of its fields", value)
    try:
        return Reference(**value)
    except FieldError:
        raise
    except TypeError as exc:
        raise FieldValueError("reference", "a mapping of call, inputs, objects, constants and returns",
                              dict(value)) from exc


def _torch_nn():
    try:
        import torch.nn as nn
    except ImportError as exc:
        raise PlanError("building a plan from a module needs torch: pip install torch",
                        element="plan_from_module") from exc
    return nn


def normalized(plan: Plan) -> Plan:
    """The plan with order-free declarations sorted, for comparing plans by meaning.

    Buffers, streams, channels and prewarm hooks are looked up by name, so their order
    carries no meaning and is sorted by name; segment order (execution order) and
    family order (capture order) are kept. Origins are already outside equality and
    mappings (symbols, capacity) are sorted by the plan itself, so
    ``normalized(a) == normalized(b)`` says two plans declare the same thing.
    """
    def by_name(items):
        return tuple(sorted(items, key=lambda item: item.name))

    return attrs.evolve(plan, buffers=by_name(plan.buffers), streams=by_name(plan.streams),
                        channels=by_name(plan.channels), prewarm=by_name(plan.prewarm), origins={})
