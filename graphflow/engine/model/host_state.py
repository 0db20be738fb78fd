"""Host state: plain Python values that graph code changes, which no replay reproduces.

A graph replays the kernels it recorded with the values their launches were given at
capture, and runs no Python. A model that keeps part of its state in Python (a position
counter as an ``int``, a "cache is full" ``bool``, lengths in a list) and changes it in
code a graph records runs correctly eagerly, but its graph keeps the value it saw when
captured: every replay computes with that one value, and wrong results come from the
first step on (Hugging Face's sliding-window cache layers kept such an int). Verify,
when on, refuses such a capture without being able to say which value was the cause;
with verify off nothing did. So warmup reads those values around graph code
(``StepWatch``) and refuses the plan, naming the segment and the value. Each part of
the check is the way it is for a reason:

* **Around each graph piece, not around the step.** An eager segment runs at every
  replay, and so does a break of a PIECEWISE segment (its submodule runs eagerly
  between the segment's graphs): the Python state they keep moves as it does eagerly.
  Only a change made inside graph code is lost at replay. So the values are read before
  and after each graph segment call, and, in a PIECEWISE descriptor, before and after
  each of its breaks: only what changes inside a graph piece counts. (A break of a
  compiled segment is not bracketed: hooks on its submodule would change what dynamo
  compiled; its changes count as the graph's.)
* **A change every replay reproduces passes.** A value a graph piece sets from the batch
  size alone (``self.batch_size = x.shape[0]``, as Hugging Face's cache layers keep one)
  has the same value after every call at that size, whatever it was before: the graph
  captured at that size saw it, and its replays compute what the eager step would. A
  counter, a toggle or a list that grows does not. The rule tells them apart by running
  the step twice at the descriptor's size: a value a graph piece changed in the second
  step is refused unless the first step's same piece left it with the same value (two
  calls, from different values before, ending at one value: it does not follow the
  value before). ``self.n += 1`` leaves 1 then 2 and is refused; ``self.b = x.shape[0]``
  leaves 8 then 8 and passes, whatever size ran before.
* **The same verdict everywhere.** The first step of the descriptor's warmup is always
  read; a second only when the first changed something inside a graph piece (a value
  that appeared there included), and then warmup runs one more step if its own steps
  were done. So the verdict depends on the model alone, not on ``warmup_iters``, the
  CUDA backend's extra pool-probe step, or which size ran before (the CPU backend used
  to refuse ``cache.batch_size: 1 -> 8``, read across the only step of a model run at
  size 1 before, while the CUDA backend read its second step and let it through).
  Ranks whose collectives pair up step by step always read two: a step one rank chose
  to run would leave the others waiting.
* **What changes, not what is read.** A value eager code advances and graph code reads
  (transformers' own sliding-window layer in a PIECEWISE plan: its count moves in the
  eager attention, the position ids computed in the graph read it) passes here; the
  graph keeps the value it read at capture, and verify refuses the capture, without
  naming the value. Seeing reads would take hooks on every attribute read.
* **What is read.** ``None``, bools, ints, floats, strs, enum members and tuples of
  them, in the attributes of the model's modules and of the objects they hold (a cache
  and its layers, dataclasses, attrs instances with or without slots), in the items of
  the lists, tuples and dicts among them, and the length of each such list and dict,
  up to ``DEPTH`` objects and containers from a module and ``ITEMS`` items a container;
  and the same from each object the plan adopts a tensor from, under the plan's path
  for it. A value is named by its path: ``layers.0.lens[0]``, ``cache.layers.0.pos``,
  ``len(layers.0.history)``. Never a tensor (the plan's buffers are the plan's
  business), and not graphflow's own objects (channel handles, JIT kernels; a model's
  own code in ``graphflow.integrations`` is read). A value that appears (lazy
  initialization at the first call) is not a change; a value that then changes at
  every step is.
* **Cheap enough to read around every segment.** The walk, which finds where every
  value sits, runs once a step and again only when the structure changed (an attribute
  added, an object replaced, a list resized). Between walks a read is a few C-level
  maps over what the walk found (the values, each container's length, the identity of
  each object held), and two reads compare by identity first. The dsv4 plans' model
  with 61 layers holds 756 values: a walk takes 2 ms, a read about 30 us.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import operator
import types
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs
import torch

from graphflow.errors import CaptureError, OptionFix

__all__ = ["DEPTH", "ITEMS", "Read", "Reader", "StepWatch", "ValueLayout", "changes"]

#: How many objects and containers from a module the walk follows
#: (module -> cache -> its list of layers -> a layer -> its plain values).
DEPTH = 4
#: How many items of one list, tuple or dict are read; a longer one is read by its length.
ITEMS = 64
_SCALARS = (type(None), bool, int, float, str, enum.Enum)
#: Values that are not the model's plain state even where they sit beside it.
_SKIPPED = (torch.Tensor, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
            types.ModuleType, torch.dtype, torch.device, bytes, bytearray)
#: nn.Module's own bookkeeping (its children, tensors and hooks, walked or not elsewhere),
#: and its ``training`` flag, which a step does not change.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
#: A value a path does not have (in one read, or in one step).
_MISSING = type("Missing", (), {"__repr__": lambda self: "unset"})()


@attrs.frozen(eq=False)
class ValueLayout:
    """Where the walk found every value, as flat tuples a read maps over.

    ``items``/``attrs``: (container, key) pairs read with ``getitem`` (a dict, a list, an
    object's ``__dict__``) and ``getattr`` (an object's slots); ``paths`` names them, the
    items' first. ``sized``: every dict and list walked, whose length changes when
    attributes or items come and go; ``counted`` names those whose length is a value
    (lists and dicts, not an object's attributes); ``lengths``: theirs at the walk.
    ``held``: the objects the walk went into, and where it found them, to see one
    replaced. Any of those moved, a read gives None: the layout no longer says where
    every value is."""

    items: tuple[tuple, tuple]
    attrs: tuple[tuple, tuple]
    paths: tuple[str, ...]
    sized: tuple
    counted: tuple[tuple[int, str], ...]
    held_items: tuple[tuple, tuple]
    held_attrs: tuple[tuple, tuple]
    held: tuple
    lengths: tuple[int, ...]

    def read(self) -> Read | None:
        """The values now, or None when the structure moved (walk again)."""
        if tuple(map(len, self.sized)) != self.lengths:
            return None
        try:
            held = (*map(operator.getitem, *self.held_items), *map(getattr, *self.held_attrs))
            if not all(map(operator.is_, held, self.held)):
                return None
            return self.values()
        except (KeyError, IndexError, AttributeError):
            return None

    def values(self) -> Read:
        """The values where the walk found them (right after it, nothing has moved)."""
        return Read(self, (*map(operator.getitem, *self.items), *map(getattr, *self.attrs)), self.lengths)


@attrs.frozen(eq=False)
class Read:
    """The values of one ``ValueLayout`` at one moment, and its containers' lengths."""

    layout: ValueLayout
    values: tuple
    lengths: tuple[int, ...]

    def by_path(self) -> dict[str, object]:
        """Every value by its path, lengths as ``len(path)``."""
        found = dict(zip(self.layout.paths, self.values))
        found.update((f"len({path})", self.lengths[index]) for index, path in self.layout.counted)
        return found


def changes(before: Read, after: Read) -> list[tuple[str, object, object]]:
    """(path, before, after) for each value both reads have and that differs (a value
    that appeared is not a change). Two reads of one layout (nothing moved in between)
    compare by identity first, the common case of nothing changed."""
    if before.layout is after.layout:
        if all(map(operator.is_, before.values, after.values)):
            return []
        return [(path, old, new) for path, old, new in zip(before.layout.paths, before.values, after.values)
                if not _same(old, new)]
    old, new = before.by_path(), after.by_path()
    return [(path, old[path], value) for path, value in new.items() if path in old and not _same(old[path], value)]


def _same(a: object, b: object) -> bool:
    """Whether two values read at one path are the same value: of one type and equal. A
    value that is no longer plain (a tensor put where an int was) is left alone: never
    compared, so no tensor op runs."""
    if a is b or not (_plain(a) and _plain(b)):
        return True
    return type(a) is type(b) and a == b


class Reader:
    """Reads the plain values reachable from a model (see the module docstring), walking
    again only when the structure moved."""

    def __init__(self, model: object, extra: Mapping[str, object] = {}):
        self._model = model
        self._extra = dict(extra)
        self._layout: ValueLayout | None = None

    def read(self, *, walk: bool = False) -> Read:
        """The values now; ``walk`` finds them afresh (a submodule added since, which no
        length the layout watches shows, is seen only by a walk)."""
        if not walk and self._layout is not None:
            found = self._layout.read()
            if found is not None:
                return found
        self._layout = _walk(self._model, self._extra)
        return self._layout.values()


@attrs.define
class _Piece:
    """One graph piece of one step: a graph segment call, or one of its parts between
    breaks; ``label`` names it for a person."""

    label: str
    before: Read
    after: Read | None = None

    def moved(self) -> bool:
        """Whether anything changed inside it, an attribute that appeared included."""
        return self.before.layout is not self.after.layout or bool(changes(self.before, self.after))


class StepWatch:
    """The host-state check of one descriptor's warmup.

    ``stepping()`` brackets a step that is read, ``runner(run)`` wraps the segment runner
    of that step, ``wants_step()`` says whether the next step is read, ``check()`` raises
    what the steps read show (see the module docstring for the rule). ``breaks``: for the
    graph segments whose breaks run eagerly in this descriptor, the submodules they break
    at, by segment. ``paired``: ranks pair up their collectives step by step, so every
    rank reads the second step, whatever its first showed (a step one rank decided to
    run alone would leave the others waiting in its collectives)."""

    def __init__(self, model: object, holders: Mapping[str, object],
                 breaks: Mapping[str, Sequence[tuple[str, torch.nn.Module]]] = {}, *, paired: bool = False):
        self._reader = Reader(model, holders)
        self._breaks = breaks
        self._paired = paired
        self._steps: list[dict[tuple[str, int], _Piece]] = []
        self._last: Read | None = None  # the latest read, while nothing ran since
        self._segment: str | None = None  # the graph segment being called
        self._part = 0  # which of its pieces
        self._inside = 0  # how deep in its breaks
        self._piece: _Piece | None = None

    def wants_step(self) -> bool:
        """The first step is read; a second when the first changed something inside graph
        code (always, when ``paired``)."""
        if not self._steps:
            return True
        return len(self._steps) == 1 and (self._paired or any(piece.moved() for piece in self._steps[0].values()))

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """One step read: a fresh walk at its start, the breaks bracketed while it runs."""
        self._steps.append({})
        self._last = self._reader.read(walk=True)
        with contextlib.ExitStack() as hooks:
            for segment, modules in self._breaks.items():
                for path, module in modules:
                    hooks.callback(module.register_forward_pre_hook(self._entering(segment)).remove)
                    hooks.callback(module.register_forward_hook(self._leaving(segment, path)).remove)
            try:
                yield
            finally:
                self._segment, self._piece, self._inside, self._last = None, None, 0, None

    def runner(self, run: Callable) -> Callable:
        """``run``, with each graph segment call between reads."""
        def observed(segment, call) -> None:
            if not segment.is_graph:
                run(segment, call)
                self._last = None
                return
            self._segment, self._part = segment.name, 0
            self._begin(segment.name)
            run(segment, call)
            self._end()
            self._segment = None

        return observed

    def check(self) -> None:
        """Raise a CaptureError naming each value a graph piece changed in the second step
        read that the first step's same piece left otherwise."""
        if len(self._steps) < 2:
            return
        first, second = self._steps
        refused: list[tuple[str, str, str]] = []  # (segment, where, what)
        for (segment, part), piece in second.items():
            found = changes(piece.before, piece.after)
            earlier = first.get((segment, part))
            before = earlier.before.by_path() if found and earlier is not None else {}
            after = earlier.after.by_path() if found and earlier is not None else {}
            for path, old, new in found:
                left = after.get(path, _MISSING)
                if left is _MISSING or not _same(left, new):
                    refused.append((segment, piece.label, f"{path}: {before.get(path, _MISSING)!r} -> {left!r}, "
                                                          f"then {old!r} -> {new!r}"))
        if refused:
            raise _refusal(refused)

    def _begin(self, label: str) -> None:
        read = self._last if self._last is not None else self._reader.read()
        self._piece = _Piece(label, read)

    def _end(self) -> None:
        piece, self._piece = self._piece, None
        piece.after = self._last = self._reader.read()
        key = (self._segment, self._part)
        self._steps[-1].setdefault(key, piece)

    def _entering(self, segment: str):
        def hook(module, args) -> None:
            if self._segment != segment:
                return
            if self._inside == 0:
                self._end()
            self._inside += 1

        return hook

    def _leaving(self, segment: str, path: str):
        def hook(module, args, output) -> None:
            if self._segment != segment:
                return
            self._inside -= 1
            if self._inside == 0:
                self._last = None
                self._part += 1
                self._begin(f"{segment} (after its break {path})")

        return hook


def _refusal(refused: list[tuple[str, str, str]]) -> CaptureError:
    shown = "; ".join(f"in {where}, {what}" for _, where, what in refused[:8])
    more = f" (and {len(refused) - 8} more)" if len(refused) > 8 else ""
    return CaptureError(
        f"{len(refused)} value(s) the model keeps in Python changed inside graph code, and differently at the next "
        f"step at this size, so no replay reproduces them (a graph runs no Python: it keeps each value as it was at "
        f"capture): {shown}{more}",
        segment=refused[0][0],
        hint="keep the value in a tensor on the device that the step updates in place (a buffer the plan owns, "
             "adopt: <path>, or one the module registers), or move its update into an eager segment or a break "
             "(breaks: [<submodule>]), which runs at every replay; a value set from the batch size alone "
             "(x.shape[0]) passes. Only if nothing reads it, turn this check off with {0}",
        settings=(OptionFix("disabled_checks", {"host_state"}),))


class _Walk:
    """One walk of the model, gathering a ``ValueLayout``."""

    def __init__(self):
        self.seen: set[int] = set()
        self.items: list[tuple[object, object, str]] = []
        self.attrs: list[tuple[object, str, str]] = []
        self.sized: list[object] = []
        self.counted: list[tuple[int, str]] = []
        self.held_items: list[tuple[object, object, object]] = []
        self.held_attrs: list[tuple[object, str, object]] = []

    def layout(self) -> ValueLayout:
        return ValueLayout(items=_columns(self.items, 2), attrs=_columns(self.attrs, 2),
                           paths=tuple(p for *_, p in itertools.chain(self.items, self.attrs)),
                           sized=tuple(self.sized), counted=tuple(self.counted),
                           held_items=_columns(self.held_items, 2), held_attrs=_columns(self.held_attrs, 2),
                           held=tuple(h for *_, h in itertools.chain(self.held_items, self.held_attrs)),
                           lengths=tuple(map(len, self.sized)))

    def object(self, owner: object, path: str, depth: int) -> None:
        """An object's attributes (its ``__dict__`` and its slots)."""
        if id(owner) in self.seen:
            return
        self.seen.add(id(owner))
        module = isinstance(owner, torch.nn.Module)
        attributes = getattr(owner, "__dict__", None)
        if isinstance(attributes, dict):
            self.sized.append(attributes)
            for name, value in list(attributes.items()):
                if not (module and name in _MODULE_INTERNALS):
                    self.value(attributes, name, value, f"{path}.{name}" if path else name, depth, getitem=True)
        for name in _slots(type(owner)):
            value = getattr(owner, name, _MISSING)
            if value is not _MISSING:
                self.value(owner, name, value, f"{path}.{name}" if path else name, depth, getitem=False)

    def value(self, owner: object, key: object, value: object, path: str, depth: int, *, getitem: bool) -> None:
        """One value where ``owner[key]`` (or ``getattr(owner, key)``) holds it: read it when
        plain, else go into it while ``depth`` lasts."""
        if _plain(value):
            (self.items if getitem else self.attrs).append((owner, key, path))
            return
        if depth <= 0 or not _walked(value):
            return
        (self.held_items if getitem else self.held_attrs).append((owner, key, value))
        if isinstance(value, (list, tuple, dict)):
            self.container(value, path, depth - 1)
        else:
            self.object(value, path, depth - 1)

    def container(self, container: list | tuple | dict, path: str, depth: int) -> None:
        if id(container) in self.seen:
            return
        self.seen.add(id(container))
        if not isinstance(container, tuple):
            self.counted.append((len(self.sized), path))
            self.sized.append(container)
        if isinstance(container, dict):
            entries = ((key, item) for key, item in container.items() if _plain(key))
        else:
            entries = enumerate(container)
        for key, item in itertools.islice(entries, ITEMS):
            self.value(container, key, item, f"{path}[{key!r}]", depth, getitem=True)


def _walk(model: object, extra: Mapping[str, object]) -> ValueLayout:
    """The layout of every value reachable from ``extra`` (first: the plan's paths for
    the objects it adopts from) and from each of the model's modules."""
    walk = _Walk()
    for path, holder in extra.items():
        walk.object(holder, path, DEPTH)
    if isinstance(model, torch.nn.Module):
        for path, module in model.named_modules():
            walk.object(module, path, DEPTH)
    else:
        walk.object(model, "", DEPTH)
    return walk.layout()


def _columns(rows: list[tuple], width: int) -> tuple:
    """The first ``width`` columns of ``rows``, each a tuple (what ``map`` takes)."""
    return tuple(tuple(row[i] for row in rows) for i in range(width))


def _slots(cls: type) -> tuple[str, ...]:
    """The slot attributes of ``cls`` and its bases, by the name ``getattr`` takes."""
    names: list[str] = []
    for base in cls.__mro__:
        slots = base.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{base.__name__.lstrip('_')}{name}"
            names.append(name)
    return tuple(names)


def _walked(value: object) -> bool:
    """Whether the walk goes into ``value``: not a module (walked from the model's
    ``named_modules``, under its own path), a tensor or code, nor graphflow's own
    objects (a model's own code in ``graphflow.integrations`` is walked)."""
    if isinstance(value, (torch.nn.Module, *_SKIPPED)):
        return False
    if isinstance(value, (list, tuple, dict)):
        return True
    module = type(value).__module__
    if module.startswith("graphflow.") and not module.startswith("graphflow.integrations."):
        return False
    return isinstance(getattr(value, "__dict__", None), dict) or bool(_slots(type(value)))


def _plain(value: object) -> bool:
    return isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(map(_plain, value)))
