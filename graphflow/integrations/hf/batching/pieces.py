"""PIECEWISE keys: the engine's step captured in pieces, its attention calls eager between them.

A FULL graph fixes everything its step reads, and paged attention reads masks and indices
whose shapes follow the KV tokens a batch reads and its longest key sequences: a FULL key
is a (q, kv, seqlens), and a server with a long cache needs hundreds of them, most never
served. A PIECEWISE key fixes the padded query tokens alone: everything of the step
(``ModelRunner._forward_process_and_sample``: carry-over, the model's forward, the logits,
sampling into ``output_ids``) is captured but the attention calls, and each of those runs
eagerly between two pieces, on the *current* step's batch arguments (``read_index``,
``write_index``, the masks, ``cu_seq_lens_*``, ``max_seqlen_*``, the cache). One key then
serves every varlen batch of its q, whatever KV it reads.

How (``AttentionCut``, one per served engine):

* **The attention function** the model calls (``ALL_ATTENTION_FUNCTIONS[name]``, ``name``
  its config's ``_attn_implementation``: ``paged|sdpa``, ``paged|eager``) is wrapped in
  transformers' registry for the whole process (``_Hook``: one wrapper per name however
  many engines are served, the function put back when the last one closes). On a thread
  that does no piecewise work of graphflow's, the wrapper calls the function.
* **Warm run** (``warming``): a key's step once eagerly before its capture, for what a
  capture cannot do: make the libraries' per-thread state, and size the static buffers
  from its calls and keep each call's output as a template (its shape and layout: (batch,
  tokens, heads, head dim) from the paged SDPA and eager attentions, (tokens, heads, head
  dim) from flash's varlen one), which the capture's static output view takes, at any
  query tokens once the dimension holding them is known (``_Output``; without a warm run,
  a lazy capture on the CPU, the interface's). The attention, whose per-shape state is
  made at each new shape, runs outside the pieces: one warm run per thread serves every
  PIECEWISE key (``needs_warming``).
* **Capture** (``recording``): at each call, the query, key and value are copied into the
  static buffers (the copies are part of the piece being recorded), the call's arguments
  are mapped (``AttentionCall``), and the backend cuts the capture (``Backend.cut``): the
  piece ends, and the next begins with the static output buffer as the call's output.
* **Replay** (``Pieces.replay(graph, batch)``): the step's batch is handed to the eager
  calls; each is the attention function on the static query, key and value and the
  arguments read from the batch, its output copied into the static output buffer.

**Arguments.** At capture, an argument that is (by identity) an entry of the step's batch
(``batch_data``), or a tensor inside a dict or list entry of it (the per-layer-type masks,
the per-group indices), is read from the current batch at replay, by that path; a plain
value whose keyword the batch has (``max_seqlen_q``) likewise. The module, its weights and
the other plain values (dropout, scaling, the sliding window) are constants. Any other
tensor is a ``CaptureError`` naming the argument: replayed, it would be the tensor of the
batch captured. A capture maps against the batch of the step it records, and a replay
reads the batch the engine hands its step (``StepRunner.compute_batch``): the engine's
``get_model_kwargs`` builds both alike.

**Static buffers** (``AttentionBuffers``): one each for the query, key, value and output,
shared by every layer and every key: a layer's call reads them before the next layer's
piece writes them again, all on the engine's compute stream. They are sized for
``max_batch_tokens`` (a key of q tokens uses views of their first q rows) at the first
warm run, and never move once a capture used them. Keeping each layer's query, key and
value in the graph pool instead would hold about 12 MiB per layer of Llama-3-8B at
q=1024, GiBs over every key.

On a backend that records no graph (the CPU), nothing is cut: a capture runs the step, a
replay runs it again, and each attention call is served where it is made as a replay
serves it (copied into the static buffers, its arguments read from the replay's batch by
the paths mapped at capture), so the mapping is what the CPU tests exercise.

The attention's second output (its weights: None from the paged SDPA, the weights from
the paged eager) is None here: continuous batching never reads it, and its shape follows
the KV tokens, which no piece may fix.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import ClassVar

import attrs
import torch

from graphflow.errors import CaptureError, PlanError

__all__ = ["AttentionBuffers", "AttentionCall", "AttentionCut", "Pieces"]

#: The attention interface's positional arguments, for messages.
_POSITIONAL = ("module", "query", "key", "value", "attention_mask")
#: The arguments copied into the static buffers, by position.
_STATIC = {1: "query", 2: "key", 3: "value"}

#: The piecewise work this thread does now (``_Warming``, ``_Recording``, ``_Replaying``),
#: read by the registry's wrapper at every attention call: a lazy capture records on its own
#: thread while the engine's thread steps.
_work = threading.local()


# -- where an argument comes from at replay --------------------------------------------------


@attrs.frozen
class FromStatic:
    """The query, key or value: the static buffer's view it was copied into."""

    role: str

    def value(self, views: _Views, batch: dict) -> object:
        return getattr(views, self.role)


@attrs.frozen
class FromBatch:
    """An entry of the step's batch, or a value inside a dict or list entry of it."""

    path: tuple[str | int, ...]

    def value(self, views: _Views, batch: dict) -> object:
        found = batch
        try:
            for part in self.path:
                found = found[part]
        except (KeyError, IndexError, TypeError) as exc:
            raise _Missing(self) from exc
        return found

    def __str__(self) -> str:
        return "batch" + "".join(f"[{part!r}]" for part in self.path)


@attrs.frozen
class Fixed:
    """A constant: the module, one of its weights, a plain value."""

    constant: object = attrs.field(eq=False)

    def value(self, views: _Views, batch: dict) -> object:
        return self.constant


Source = FromStatic | FromBatch | Fixed


class _Missing(LookupError):
    """A path of the batch captured that the batch replayed lacks."""

    def __init__(self, source: FromBatch) -> None:
        super().__init__(str(source))
        self.source = source


@attrs.frozen
class AttentionCall:
    """One attention call of a step, as a replay makes it again: where each of its
    arguments comes from (see the module docstring)."""

    where: str
    args: tuple[Source, ...]
    kwargs: tuple[tuple[str, Source], ...]

    @classmethod
    def of(cls, args: tuple, kwargs: dict, batch: dict) -> AttentionCall:
        """The call made with ``args`` and ``kwargs`` while ``batch`` was the step's batch;
        a ``CaptureError`` naming an argument no replay could make again."""
        module = args[0] if args else None
        where = _where(module)
        if len(args) < 4:
            raise CaptureError(f"{where}: the attention was called with {len(args)} positional arguments; a "
                               "PIECEWISE key needs the attention interface's (module, query, key, value, ...) "
                               "to copy the query, key and value", hint="the key is served eagerly")
        sources = tuple(FromStatic(_STATIC[i]) if i in _STATIC else
                        _source(_POSITIONAL[i] if i < len(_POSITIONAL) else f"argument {i}", None, value, batch,
                                module, where)
                        for i, value in enumerate(args))
        named = tuple((name, _source(name, name, value, batch, module, where)) for name, value in kwargs.items())
        return cls(where, sources, named)

    def arguments(self, views: _Views, batch: dict) -> tuple[tuple, dict]:
        """The arguments of this call on ``batch``, the step being replayed."""
        try:
            return (tuple(s.value(views, batch) for s in self.args),
                    {name: s.value(views, batch) for name, s in self.kwargs})
        except _Missing as missing:
            raise CaptureError(f"{self.where}: the step's batch has no {missing.source}, which the attention read "
                               "when its key was captured", hint="the key is served eagerly") from missing


def _source(name: str, keyword: str | None, value: object, batch: dict, module, where: str) -> Source:
    if keyword is not None and keyword in batch:
        entry = batch[keyword]
        if value is entry or (not _holds_tensor(value) and type(value) is type(entry) and value == entry):
            return FromBatch((keyword,))
    if _holds_tensor(value):
        path = _found(value, batch)
        if path is not None:
            return FromBatch(path)
        if isinstance(value, torch.Tensor) and _is_weight(value, module):
            return Fixed(value)
        raise CaptureError(f"{where}: the attention's argument {name!r} holds a tensor that is neither an entry of "
                           "the step's batch (batch_data) nor a weight of the module: a PIECEWISE replay would hand "
                           "the attention the tensor of the batch captured, not the current one's",
                           hint="the key is served eagerly; pass the tensor through the model's batch arguments")
    return Fixed(value)


def _found(value: object, batch: dict) -> tuple[str | int, ...] | None:
    """The path of ``value`` in ``batch``, by identity: an entry, or a value of a dict or
    list entry."""
    for name, entry in batch.items():
        if entry is value:
            return (name,)
        inner = entry.items() if isinstance(entry, dict) else enumerate(entry) if isinstance(entry, (list, tuple)) \
            else ()
        for part, item in inner:
            if item is value:
                return (name, part)
    return None


def _holds_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _is_weight(tensor: torch.Tensor, module) -> bool:
    if not isinstance(module, torch.nn.Module):
        return False
    return any(tensor is t for t in (*module.parameters(), *module.buffers()))


def _where(module) -> str:
    index = getattr(module, "layer_idx", None)
    name = type(module).__name__
    return f"the attention of layer {index} ({name})" if index is not None else f"the attention of {name}"


# -- the static buffers -----------------------------------------------------------------------


@attrs.frozen(eq=False)
class _Views:
    """One call's views of the static buffers: the first q tokens' rows."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor


class AttentionBuffers:
    """The static query, key, value and output buffers of one engine's PIECEWISE keys
    (see the module docstring): bytes, viewed at each call as the tensor they hold."""

    ROLES = ("query", "key", "value", "output")

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._bytes: dict[str, torch.Tensor] = {}
        #: Each call's output as the warm runs returned it, by call index.
        self._outputs: dict[int, _Output] = {}
        #: Set once a capture used the buffers: they may not move any more.
        self.fixed = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bytes.values())

    def remember(self, tokens: int, index: int, output: torch.Tensor) -> None:
        """The ``index``-th call's output at a warm run of ``tokens`` query tokens, kept as
        the template of its static output view, at these tokens and, once the dimension
        that holds them is known, at any (``_Output``)."""
        meta = torch.empty_strided(output.shape, output.stride(), dtype=output.dtype, device="meta")
        dims = frozenset(d for d, n in enumerate(output.shape) if n == tokens)
        before = self._outputs.get(index)
        if before is not None:
            dims &= before.token_dims
        self._outputs[index] = _Output(meta, tokens, dims)

    @property
    def derives(self) -> bool:
        """Whether the warm runs so far size every view a capture takes, whatever its query
        tokens: the buffers sized, and each call's output with one dimension of tokens."""
        return (set(self.ROLES) <= set(self._bytes) and bool(self._outputs)
                and all(len(o.token_dims) == 1 for o in self._outputs.values()))

    def output_like(self, tokens: int, index: int, query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The ``index``-th call's output as its warm runs returned it, at ``tokens`` query
        tokens, else as the attention interface shapes it (batch, tokens, heads, value head
        dim, from the query's (batch, heads, tokens, head dim)): a meta tensor."""
        found = self._outputs.get(index)
        template = None if found is None else found.at(tokens)
        if template is not None:
            return template
        return torch.empty((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), dtype=query.dtype,
                           device="meta")

    def fit(self, tokens: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            output: torch.Tensor) -> None:
        """Grow each buffer to hold its role's tensor at ``max_tokens`` tokens, the call's
        being of ``tokens`` (outside any capture; before the first capture)."""
        for role, tensor in zip(self.ROLES, (query, key, value, output)):
            wanted = -(-tensor.numel() * tensor.element_size() // tokens) * self.max_tokens
            held = self._bytes.get(role)
            if held is not None and held.numel() >= wanted and held.device == query.device:
                continue
            if self.fixed:
                raise CaptureError(f"the static {role} buffer of the attention holds {_numel(held)} bytes, and a call "
                                   f"needs {wanted}: its size was fixed by the first capture",
                                   hint="the key is served eagerly")
            self._bytes[role] = torch.empty(wanted, dtype=torch.uint8, device=query.device)

    def views(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> _Views:
        """Views shaped and strided like ``query``, ``key``, ``value`` and ``output`` (a
        template: ``output_like``)."""
        missing = [role for role in self.ROLES if role not in self._bytes]
        if missing:
            raise CaptureError(f"the static attention buffers ({', '.join(missing)}) were not sized before the "
                               "capture: the key's step runs once eagerly first (warming)",
                               hint="the key is served eagerly")
        return _Views(*(self._like(role, t) for role, t in zip(self.ROLES, (query, key, value, output))))

    def _like(self, role: str, tensor: torch.Tensor) -> torch.Tensor:
        """The buffer's first bytes as ``tensor``: its shape, dtype and (dense) strides."""
        held = self._bytes[role]
        size = tensor.numel() * tensor.element_size()
        if size > held.numel():
            raise CaptureError(f"the static {role} buffer of the attention holds {held.numel()} bytes, and a call "
                               f"needs {size}", hint="the key is served eagerly")
        order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))  # outermost first
        dense = held[:size].view(tensor.dtype).view([tensor.shape[d] for d in order])
        return dense.permute([order.index(d) for d in range(tensor.dim())])

    def release(self) -> None:
        self._bytes.clear()
        self._outputs.clear()


def _numel(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel()


@attrs.frozen(eq=False)
class _Output:
    """One attention call's output as the warm runs returned it: the last run's (a meta
    tensor) and its query tokens, and the dimensions whose size was the query tokens at
    every run. Once one dimension is left, the output at any tokens is the template with
    that dimension resized, dense in the same order: a key needs no warm run of its own
    for its output view. (The paged SDPA and eager attentions return (batch, tokens,
    heads, head dim), flash's varlen one (tokens, heads, head dim); a run whose tokens
    equal the head dim leaves two, and the next key's run of other tokens tells them
    apart.)"""

    template: torch.Tensor
    tokens: int
    token_dims: frozenset[int]

    def at(self, tokens: int) -> torch.Tensor | None:
        """The output at ``tokens`` query tokens (a meta tensor); None while that is not known."""
        if tokens == self.tokens:
            return self.template
        if len(self.token_dims) != 1:
            return None
        (dim,) = self.token_dims
        shape = list(self.template.shape)
        shape[dim] = tokens
        order = sorted(range(len(shape)), key=lambda d: -self.template.stride(d))  # outermost first
        dense = torch.empty([shape[d] for d in order], dtype=self.template.dtype, device="meta")
        return dense.permute([order.index(d) for d in range(len(shape))])


# -- one key's pieces -------------------------------------------------------------------------


class Pieces:
    """What a PIECEWISE key's graph needs beside its pieces: its attention calls (each with
    its views of the static buffers), and the batch they read at a replay."""

    def __init__(self) -> None:
        self.calls: list[tuple[AttentionCall, _Views]] = []
        #: Whether the backend cut the capture at the calls (it records graphs); else a
        #: replay runs the step, its attention served by the wrapper.
        self.cut = False
        #: The batch the eager calls read, while a replay runs.
        self.batch: dict | None = None

    def replay(self, graph, batch: dict) -> None:
        """``graph`` (this key's) replayed on ``batch``, the step's batch arguments."""
        self.batch = batch
        try:
            if self.cut:
                graph.replay()
            else:
                replaying = _Replaying(self, batch)
                with _doing(replaying):
                    graph.replay()
                replaying.done()
        finally:
            self.batch = None

    def eager(self, index: int, original: Callable) -> Callable[[], None]:
        """The eager call of a cut graph's ``index``-th attention, reading the batch of the replay."""
        call, views = self.calls[index]
        return functools.partial(self._serve_replayed, call, views, original)

    def _serve_replayed(self, call: AttentionCall, views: _Views, original: Callable) -> None:
        _serve(call, views, original, self.batch)

    def release(self) -> None:
        self.calls.clear()


def _serve(call: AttentionCall, views: _Views, original: Callable, batch: dict) -> tuple[torch.Tensor, None]:
    """The attention function on the static query, key and value and ``batch``'s
    arguments, its output copied into the static output buffer."""
    args, kwargs = call.arguments(views, batch)
    output = original(*args, **kwargs)[0]
    if output.shape != views.output.shape:
        raise CaptureError(f"{call.where}: the attention returned {tuple(output.shape)}, where its static output "
                           f"is {tuple(views.output.shape)} (its warm run's, or the attention interface's (batch, "
                           "tokens, heads, head dim))", hint="the key is served eagerly")
    views.output.copy_(output)
    return views.output, None


# -- what the wrapper does on each thread ----------------------------------------------------


class _Warming:
    """A key's step run eagerly before its capture: the static buffers sized from its
    calls, and each call's output kept as its template."""

    def __init__(self, buffers: AttentionBuffers, tokens: int) -> None:
        self.buffers, self.tokens = buffers, tokens
        self.index = 0

    def call(self, original: Callable, args: tuple, kwargs: dict):
        result = original(*args, **kwargs)
        output = result[0]
        if not isinstance(output, torch.Tensor):
            raise CaptureError(f"{_where(args[0])}: the attention returned a {type(output).__name__} first, not a "
                               "tensor: its output cannot be served from a static buffer",
                               hint="the key is served eagerly")
        self.buffers.remember(self.tokens, self.index, output)
        self.buffers.fit(self.tokens, *args[1:4], output)
        self.index += 1
        return result


class _Apart:
    """A key's step run warm in a pool probe: each attention call outside the probe's pool
    (``outside``), as a capture runs it outside its graphs."""

    def __init__(self, outside: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.outside = outside

    def call(self, original: Callable, args: tuple, kwargs: dict):
        with self.outside():
            return original(*args, **kwargs)


class _Recording:
    """A PIECEWISE key's capture: each call copied, mapped and cut (see the module docstring)."""

    def __init__(self, cut: AttentionCut, pieces: Pieces, batch: dict, tokens: int) -> None:
        self.cut, self.pieces, self.batch, self.tokens = cut, pieces, batch, tokens

    def call(self, original: Callable, args: tuple, kwargs: dict):
        backend, buffers = self.cut.backend, self.cut.buffers
        call = AttentionCall.of(args, kwargs, self.batch)
        query, key, value = args[1:4]
        index = len(self.pieces.calls)
        output = buffers.output_like(self.tokens, index, query, value)
        if backend.captures_graphs:
            buffers.fixed = True  # the pieces hold their addresses from now on
        else:  # nothing is recorded: the buffers may grow now
            buffers.fit(self.tokens, query, key, value, output)
        views = buffers.views(query, key, value, output)
        for static, live in ((views.query, query), (views.key, key), (views.value, value)):
            static.copy_(live)  # in the piece being recorded
        self.pieces.calls.append((call, views))
        made = backend.cut(functools.partial(self._between, index, original))
        if made is not None:
            self.pieces.cut = True
            return made
        return _serve(call, views, original, self.batch)

    def _between(self, index: int, original: Callable) -> tuple[Callable[[], None], object]:
        """Outside any capture: the eager call, and the output the next piece reads."""
        return self.pieces.eager(index, original), (self.pieces.calls[index][1].output, None)


class _Replaying:
    """A replay on a backend that records no graph: the step runs, and each attention call
    is served as a cut graph's eager call serves it."""

    def __init__(self, pieces: Pieces, batch: dict) -> None:
        self.pieces, self.batch = pieces, batch
        self.index = 0

    def call(self, original: Callable, args: tuple, kwargs: dict):
        if self.index >= len(self.pieces.calls):
            raise CaptureError(f"the replay called the attention more than the {len(self.pieces.calls)} times its "
                               "capture did", hint="the key is served eagerly")
        call, views = self.pieces.calls[self.index]
        self.index += 1
        for static, live in ((views.query, args[1]), (views.key, args[2]), (views.value, args[3])):
            static.copy_(live)
        return _serve(call, views, original, self.batch)

    def done(self) -> None:
        if self.index != len(self.pieces.calls):
            raise CaptureError(f"the replay called the attention {self.index} times, its capture "
                               f"{len(self.pieces.calls)}", hint="the key is served eagerly")


@contextlib.contextmanager
def _doing(work) -> Iterator[None]:
    before = getattr(_work, "now", None)
    _work.now = work
    try:
        yield
    finally:
        _work.now = before


# -- the registry entry ----------------------------------------------------------------------


class _Hook:
    """The wrapper on one entry of transformers' attention registry, shared by every engine
    served with that attention; the entry as it was once the last one is done."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _hooks: ClassVar[dict[str, _Hook]] = {}

    def __init__(self, registry, name: str) -> None:
        self.registry, self.name = registry, name
        self.original = registry[name]
        local = registry._local_mapping
        self._had = (name in local, local.get(name))
        self.users = 0
        #: What the registry holds while hooked (one bound method: each access makes another).
        self.entry = self.wrapper

    @classmethod
    def take(cls, registry, name: str) -> _Hook:
        with cls._lock:
            hook = cls._hooks.get(name)
            if hook is None:
                hook = cls._hooks[name] = cls(registry, name)
                registry[name] = hook.entry
            hook.users += 1
            return hook

    def give_back(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users:
                return
            del self._hooks[self.name]
            local = self.registry._local_mapping
            if local.get(self.name) is not self.entry:
                return  # replaced since: whoever replaced it keeps it
            had, before = self._had
            if had:
                local[self.name] = before
            else:
                del local[self.name]

    def wrapper(self, *args, **kwargs):
        work = getattr(_work, "now", None)
        if work is None:
            return self.original(*args, **kwargs)
        return work.call(self.original, args, kwargs)


class AttentionCut:
    """The attention calls of one engine's PIECEWISE keys (see the module docstring): the
    registry's wrapper, taken by ``attach`` and given back on ``stack``, the static
    buffers, and the contexts a key's warm run, capture and replay run in."""

    def __init__(self, attention: str, backend, max_tokens: int) -> None:
        self.attention = attention
        self.backend = backend
        self.buffers = AttentionBuffers(max_tokens)
        self._warmed = threading.local()  # ``done``: a warm run of this engine's ended on this thread

    def attach(self, stack) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.attention not in ALL_ATTENTION_FUNCTIONS:
            raise PlanError(f"attention {self.attention!r} is not in transformers' ALL_ATTENTION_FUNCTIONS: graphflow "
                            "cuts the PIECEWISE keys' capture at that function's calls", element="attention")
        hook = _Hook.take(ALL_ATTENTION_FUNCTIONS, self.attention)

        def give_back() -> None:
            hook.give_back()
            self.buffers.release()

        stack.push(f"give ALL_ATTENTION_FUNCTIONS[{self.attention!r}] back, free the static attention buffers",
                   give_back)

    def needs_warming(self) -> bool:
        """Whether a PIECEWISE key's capture on this thread needs a warm run of its own
        first. The warm run exists for what a capture cannot do: make the libraries'
        per-thread state (cuBLAS's handle and workspace, made inside a capture it fails or
        lands in the graph pool) and size the static buffers and output views. A PIECEWISE
        key's attention, whose per-shape state (cuDNN's plans) is made at each new shape,
        runs outside its graphs; what its pieces run (matmuls, norms, the logits) keeps no
        per-shape state. So after one warm run on a thread, and once the warm runs size the
        views of any query tokens (``AttentionBuffers.derives``), a key is captured cold."""
        return not getattr(self._warmed, "done", False) or not self.buffers.derives

    @contextlib.contextmanager
    def warming(self, tokens: int) -> Iterator[None]:
        """The key's step run eagerly, before its capture, on ``tokens`` query tokens."""
        with _doing(_Warming(self.buffers, tokens)):
            yield
        self._warmed.done = True

    def apart(self, outside: Callable[[], contextlib.AbstractContextManager]) -> contextlib.AbstractContextManager[None]:
        """The key's step run in a pool probe, its attention calls inside ``outside()``."""
        return _doing(_Apart(outside))

    def record(self, pieces: Pieces, call: Callable[[], None], batch: dict, tokens: int) -> None:
        """``call`` (the key's step on ``batch``, ``tokens`` query tokens) inside a
        capture, cut at its attention calls into ``pieces``."""
        with _doing(_Recording(self, pieces, batch, tokens)):
            call()
        if not pieces.calls:
            raise CaptureError(f"the step never called the attention through ALL_ATTENTION_FUNCTIONS"
                               f"[{self.attention!r}]: a PIECEWISE key would hold it inside its graph, fixed to the "
                               "KV sizes of the batch captured", hint="the key is served eagerly")
