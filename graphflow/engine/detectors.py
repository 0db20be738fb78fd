"""Capture-safety detectors: catch, while a segment runs, what would break its graph.

A CUDA graph replays the kernels and addresses recorded at capture and nothing else, so
code that works eagerly can capture into a graph that is wrong or fails to capture at
all. The engine wraps every graph segment call of warmup and capture in
``Detectors.watch``; each finding names the segment and the offending call (with the
user's source line), and the engine turns the findings into one ``CaptureError``
before anything is committed. The checks:

* ``HOST_SYNC``: a value read from a tensor into Python (``.item()``, ``int(t)``,
  ``if t.sum() > 0``), an op whose output shape depends on tensor values
  (``nonzero``, boolean-mask indexing, ``bincount``...), a device-to-host copy, or an
  explicit ``synchronize()``.
* ``FOREIGN_TENSOR``: an op argument that is neither a declared buffer, nor the model's
  parameters or buffers (``known``), nor created inside the segment.
* ``ESCAPE``: a tensor created inside a captured region and still referenced after the
  segment returns: its memory belongs to the graph's pool.
* ``UNCAPTURED_KERNEL``: during capture, an op launched on a stream that is not
  capturing: it runs once and is missing from the graph. A side stream the engine
  forked from the capture stream is capturing (joined into the capture) and is not
  flagged; a stream never joined is.
* ``CROSS_DEVICE``: tensors on another device than the segment's, CPU tensors, and
  copies between devices.

How: a ``TorchDispatchMode`` sees every ATen op (arguments before the op runs, so a
finding exists even when the op then fails inside capture), and a ``TorchFunctionMode``
names the Python call that led to it (``Tensor.item``). Both are pushed only inside
``watch``, so code outside a watch pays nothing. Storages are compared by address:
``known`` holds address ranges, intermediates are the storages first produced by an op
inside the watch. ``torch.cuda.synchronize``, ``Stream.synchronize``,
``Event.synchronize`` and ``torch.accelerator.synchronize`` are not ATen ops; inside a
watch with ``HOST_SYNC`` on they are replaced by recording wrappers and restored on
exit, even when the segment raises. This is the one place graphflow patches torch. A
function imported by name before the watch (``from torch.cuda import synchronize``) is
not seen, nor are kernels launched without the dispatcher (a raw Triton or CuTe DSL
launch): their arguments are not checked.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import os
import sys
import threading
from collections.abc import Iterable, Iterator

import attrs
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphflow.events import Phase

__all__ = ["Check", "Finding", "Detectors", "aside"]


class Check(enum.Enum):
    """One detector. Its value is the name used in reports and settings."""

    HOST_SYNC = "host_sync"
    FOREIGN_TENSOR = "foreign_tensor"
    ESCAPE = "escape"
    UNCAPTURED_KERNEL = "uncaptured_kernel"
    CROSS_DEVICE = "cross_device"
    #: Not an op check: a plain Python value the step changes (graphflow.engine.model.host_state).
    HOST_STATE = "host_state"

    @classmethod
    def default(cls) -> frozenset[Check]:
        """Every check: the engine runs all of them unless a plan disables some."""
        return frozenset(cls)


@attrs.frozen
class Finding:
    """One hazard. ``call`` is the op and the Python call that led to it, and the
    user's source line where one was found: ``aten._local_scalar_dense (Tensor.item)
    at model.py:42``. ``message`` says what breaks and how to fix it."""

    check: Check
    segment: str
    call: str
    message: str
    phase: Phase | None = None


_aten = torch.ops.aten


class _Sync(enum.Enum):
    """How an op makes the host wait for tensor values."""

    VALUE = "value"      # hands a value to Python
    SHAPE = "shape"      # output size depends on values
    MASK = "mask"        # SHAPE when an index is a boolean mask
    REPEATS = "repeats"  # SHAPE unless output_size is given


_SYNCS = {
    _aten._local_scalar_dense: _Sync.VALUE, _aten.equal: _Sync.VALUE,
    _aten.nonzero: _Sync.SHAPE, _aten.masked_select: _Sync.SHAPE, _aten._unique: _Sync.SHAPE,
    _aten._unique2: _Sync.SHAPE, _aten.unique_dim: _Sync.SHAPE, _aten.unique_consecutive: _Sync.SHAPE,
    _aten.bincount: _Sync.SHAPE,
    _aten.index: _Sync.MASK, _aten.index_put: _Sync.MASK, _aten.index_put_: _Sync.MASK,
    _aten._index_put_impl_: _Sync.MASK,
}
_REPEATS_BY_TENSOR = (_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor)
_COPIES = (_aten.copy_, _aten._to_copy, _aten._copy_from, _aten._copy_from_and_resize)
# ``torch.tensor(data)`` builds its tensor outside the dispatcher, then lifts it here.
_LIFTS = (_aten.lift_fresh, _aten.lift_fresh_copy)
# Ops that allocate or describe memory without launching a kernel.
_NO_LAUNCH = (_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided,
              _aten.lift_fresh, _aten.set_, _aten.resize_)


@attrs.frozen
class _OpKind:
    """What the detectors need to know about one ATen op overload; worked out once
    per op (``Detectors._kinds``) so the per-call path does no set lookups."""

    sync: _Sync | None
    copy: bool
    to_copy: bool
    copy_in_place: bool
    lift: bool
    launches: bool

    @classmethod
    def of(cls, func) -> _OpKind:
        packet = func.overloadpacket
        sync = _Sync.REPEATS if func in _REPEATS_BY_TENSOR else _SYNCS.get(packet)
        return cls(sync=sync, copy=packet in _COPIES, to_copy=packet is _aten._to_copy,
                   copy_in_place=packet is _aten.copy_, lift=packet in _LIFTS,
                   launches=not func.is_view and packet not in _NO_LAUNCH)


_MASK_DTYPES = (torch.bool, torch.uint8)
_HOST_READ_APIS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__})

_INTERNAL_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)

_FIX = {
    "value": ("reads a tensor's value into Python (.item(), int(t), float(t), bool(t), `if t ...`): "
              "a host synchronization, not allowed during capture, and a graph would replay the value "
              "read at capture — keep the value on the device (torch.where, masks) or move the read to "
              "an eager segment"),
    "shape": ("its output size depends on tensor values, so the host waits for the device to learn it: "
              "not allowed during capture — use a fixed-size form (nonzero_static, a mask, scatter_add_ "
              "into a preallocated buffer) or move it to an eager segment"),
    "d2h": ("copies a device tensor to host memory and waits for it: not allowed during capture — move "
            "the copy to an eager segment, or read the output buffer after replay"),
    "sync": ("waits for the device: not allowed during capture — remove it from the segment (profiling "
             "syncs must be off during warmup and capture)"),
    "host_read": ("reads tensor values into Python: a host synchronization, and a graph would replay the "
                  "values read at capture — keep them on the device or move the read to an eager segment"),
    "foreign": ("neither a declared buffer, nor a parameter or buffer of the model, nor created inside "
                "the segment: a graph replays the address it had at capture, so a tensor re-created each "
                "step is never read (or written) again — declare it as a buffer, or register it on the "
                "model, and update it in place"),
    "escape": ("created inside the captured region and still referenced after the segment returned: its "
               "memory belongs to the graph's pool and is overwritten at the next replay — write it into "
               "a declared buffer (buf.copy_(t)) or declare it as one"),
    "uncaptured": ("the current stream of {device} is not capturing, so this kernel runs once now and is "
                   "missing from the graph — run it on the capture stream, or fork a side stream from it "
                   "(side.wait_stream(capture_stream)) and join back before the region ends"),
    "device": ("a graph segment runs on one device: CPU work is not captured and cross-device traffic is "
               "a synchronous copy — keep the tensor on {device} as a declared buffer, or copy between "
               "devices in an eager segment"),
    "copy": ("a copy between devices inside a graph segment — copy in an eager segment between graphs, "
             "into a buffer on the segment's device"),
    "lift": ("torch.tensor(..., device={device}) copies host data at every call and the graph replays the "
             "values seen at capture — preallocate a buffer and update it in place"),
}


def _user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost frame outside torch and graphflow, where the
    user's code made the call; None when there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_INTERNAL_DIRS):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


def _at(call: str, frame: tuple[str, int] | None) -> str:
    return call if frame is None else f"{call} at {os.path.basename(frame[0])}:{frame[1]}"


def _storage_of(tensor: torch.Tensor):
    """The tensor's untyped storage, or None for tensors without one (sparse, nested,
    some subclasses)."""
    if tensor.layout is not torch.strided:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _address(tensor: torch.Tensor) -> int:
    """Start of the tensor's storage; 0 when it has no memory (meta, empty, sparse)."""
    storage = _storage_of(tensor)
    return storage.data_ptr() if storage is not None else 0


def _is_cpu_scalar(tensor: torch.Tensor) -> bool:
    """A 0-dim CPU tensor: what torch makes of a Python number; kernels take its value
    as an argument, so it is neither foreign nor cross-device."""
    return tensor.is_cpu and tensor.dim() == 0


def _on_device(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory is on an accelerator (neither host nor meta)."""
    return not tensor.is_cpu and not tensor.is_meta


def _resolved(device) -> torch.device | None:
    """``cuda`` means the current CUDA device: name it, so devices compare with ``==``."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _tensor_args(args, kwargs) -> list[tuple[int | str, torch.Tensor]]:
    """(position or keyword, tensor) for every tensor argument, lists included."""
    found = []
    for position, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            found.append((position, value))
        elif isinstance(value, (list, tuple)):
            found.extend((position, item) for item in value if isinstance(item, torch.Tensor))
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found.append((key, value))
        elif isinstance(value, (list, tuple)):
            found.extend((key, item) for item in value if isinstance(item, torch.Tensor))
    return found


def _argument_name(func, position: int | str) -> str:
    if isinstance(position, str):
        return position
    arguments = func._schema.arguments
    return arguments[position].name if position < len(arguments) else str(position)


def _label(func, api) -> str:
    """``aten._local_scalar_dense (Tensor.item)``: the op, and the Python call behind it."""
    name = str(func.overloadpacket).replace("::", ".", 1)
    if api is None or isinstance(api, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return name  # called as torch.ops.aten...: the op is the call
    return f"{name} ({_api_name(api)})"


def _describe(dtype: torch.dtype, device: torch.device) -> str:
    return f"{str(dtype).removeprefix('torch.')} tensor on {device}"


class _Known:
    """Address ranges of the known tensors' storages, merged and sorted, so a view of a
    buffer (or another storage object over the same memory) counts as the buffer."""

    def __init__(self):
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        ranges = list(zip(self._starts, self._ends))
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"known tensors must be torch.Tensor (got {type(tensor).__name__})")
            storage = _storage_of(tensor)
            if storage is not None and storage.data_ptr():
                ranges.append((storage.data_ptr(), storage.data_ptr() + max(storage.nbytes(), 1)))
        ranges.sort()
        merged: list[list[int]] = []
        for start, end in ranges:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [start for start, _ in merged]
        self._ends = [end for _, end in merged]

    def __contains__(self, address: int) -> bool:
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address < self._ends[i]


@attrs.define
class _Birth:
    """Where an intermediate of a captured region was created, for ESCAPE findings;
    names are formatted only if it escapes."""

    ref: StorageWeakRef
    func: object
    api: object
    frame: tuple[str, int] | None
    dtype: torch.dtype
    device: torch.device


class _Watch:
    """The state of one ``watch``: one segment call. Holds addresses and weak
    references only, so it never keeps the segment's tensors alive."""

    def __init__(self, owner: Detectors, segment: str, phase: Phase, capturing: bool, device):
        self.owner = owner
        self.segment = segment
        self.phase = phase
        self.device = _resolved(device)
        checks = owner.checks
        self.host_sync = Check.HOST_SYNC in checks
        self.foreign = Check.FOREIGN_TENSOR in checks
        self.cross_device = Check.CROSS_DEVICE in checks
        self.uncaptured = capturing and Check.UNCAPTURED_KERNEL in checks
        self.escape = capturing and Check.ESCAPE in checks
        self.thread = threading.get_ident()
        self.open = True
        self.api = None  # the outermost torch function running now, for naming calls
        self.in_host_read = False
        # address -> _Birth when tracking escapes, else None: storages made by ops here
        self.created: dict[int, _Birth | None] = {}
        self.flagged: set[int] = set()
        self.eager = 0  # inside ``Detectors.eager()``: work that runs eagerly at replay too

    def record(self, check: Check, call: str, message: str, locate: bool = True) -> None:
        if self.eager:  # runs eagerly at replay too: nothing of capture's rules applies
            return
        if locate:
            call = _at(call, _user_frame())
        self.owner._add(Finding(check, self.segment, call, message, self.phase))

    def label(self, func) -> str:
        return _label(func, self.api)

    # -- per op, before it runs: findings exist even if the op then fails in capture --

    def before(self, func, args, kwargs) -> set[int]:
        """Check one op's arguments; the addresses of their storages."""
        kind = self.owner._kind(func)
        tensors = _tensor_args(args, kwargs)
        if kind.lift:
            for _, tensor in tensors:
                self.created.setdefault(_address(tensor), None)
        addresses = set()
        for position, tensor in tensors:
            address = _address(tensor)
            if address:
                addresses.add(address)
            if (self.foreign and address and address not in self.created and address not in self.flagged
                    and not _is_cpu_scalar(tensor) and address not in self.owner._known):
                self.flagged.add(address)
                self.record(Check.FOREIGN_TENSOR, self.label(func),
                            f"argument '{_argument_name(func, position)}' is a {_describe(tensor.dtype, tensor.device)} that is "
                            + _FIX["foreign"])
        if self.in_host_read:
            return addresses  # tolist/numpy: already one HOST_SYNC finding; its copy is no news
        if self.cross_device:
            self._check_devices(func, kind, tensors, kwargs)
        if self.host_sync and (kind.sync is not None or kind.copy):
            self._check_host_sync(func, kind, args, kwargs)
        if self.uncaptured and kind.launches:
            self._check_stream(func, tensors, kwargs)
        return addresses

    def _check_devices(self, func, kind: _OpKind, tensors, kwargs) -> None:
        if kind.lift:
            for _, tensor in tensors:
                if not tensor.is_cpu:
                    self.record(Check.CROSS_DEVICE, self.label(func), _FIX["lift"].format(device=tensor.device))
            return
        if kind.to_copy and tensors and kwargs.get("device") is not None:
            source, target = tensors[0][1].device, _resolved(kwargs["device"])
            if source != target or (self.device is not None and target != self.device):
                self.record(Check.CROSS_DEVICE, self.label(func), f"copies from {source} to {target}: " + _FIX["copy"])
                return
        devices = set()
        for position, tensor in tensors:
            if not kind.copy and _is_cpu_scalar(tensor):
                continue
            device = tensor.device
            if self.device is not None and device != self.device:
                reason = (f"argument '{_argument_name(func, position)}' is a {_describe(tensor.dtype, tensor.device)} in a segment "
                          f"on {self.device}: ")
                self.record(Check.CROSS_DEVICE, self.label(func),
                            reason + (_FIX["copy"] if kind.copy else _FIX["device"].format(device=self.device)))
                return
            devices.add(device)
        if len(devices) > 1:
            names = ", ".join(sorted(str(d) for d in devices))
            self.record(Check.CROSS_DEVICE, self.label(func), f"mixes tensors on {names}: "
                        + (_FIX["copy"] if kind.copy else _FIX["device"].format(device="one device")))

    def _check_host_sync(self, func, kind: _OpKind, args, kwargs) -> None:
        sync = kind.sync
        if sync is _Sync.VALUE:
            self.record(Check.HOST_SYNC, self.label(func), _FIX["value"])
        elif sync is _Sync.SHAPE or (sync is _Sync.REPEATS and kwargs.get("output_size") is None):
            self.record(Check.HOST_SYNC, self.label(func), _FIX["shape"])
        elif sync is _Sync.MASK and len(args) > 1 and any(
                isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES for index in args[1]):
            self.record(Check.HOST_SYNC, self.label(func), "indexes with a boolean mask: " + _FIX["shape"])
        elif kind.to_copy and args and _on_device(args[0]):
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu":
                self.record(Check.HOST_SYNC, self.label(func), _FIX["d2h"])
        elif kind.copy_in_place and len(args) > 1 and args[0].is_cpu and _on_device(args[1]):
            self.record(Check.HOST_SYNC, self.label(func), _FIX["d2h"])

    def _check_stream(self, func, tensors, kwargs) -> None:
        device = next((tensor.device for _, tensor in tensors if tensor.is_cuda), None)
        if device is None and kwargs.get("device") is not None:
            device = torch.device(kwargs["device"])
        if device is None or device.type != "cuda":
            return
        if not _stream_capturing(device):
            self.record(Check.UNCAPTURED_KERNEL, self.label(func), _FIX["uncaptured"].format(device=device))

    # -- per op, after it ran: remember the storages it created --

    def after(self, func, out, inputs: set[int]) -> None:
        if isinstance(out, torch.Tensor):
            self._created(func, out, inputs)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._created(func, item, inputs)

    def _created(self, func, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = _storage_of(tensor)
        address = storage.data_ptr() if storage is not None else 0
        if not address or address in inputs:
            return
        if address in self.created:
            birth = self.created[address]
            if birth is None or not birth.ref.expired():
                return  # a view of an intermediate, or not tracking escapes
        elif address in self.owner._known:
            return
        if self.escape:
            self.created[address] = _Birth(StorageWeakRef(storage), func, self.api, _user_frame(),
                                           tensor.dtype, tensor.device)
        else:
            self.created[address] = None

    def made_eagerly(self, out) -> None:
        for item in out if isinstance(out, (tuple, list)) else (out,):
            storage = _storage_of(item) if isinstance(item, torch.Tensor) else None
            if storage is not None and storage.data_ptr():
                self.created.setdefault(storage.data_ptr(), None)

    def check_escapes(self) -> None:
        for address, birth in self.created.items():
            if birth is not None and not birth.ref.expired() and address not in self.owner._known:
                call = _at(_label(birth.func, birth.api), birth.frame)
                self.record(Check.ESCAPE, call, f"a {_describe(birth.dtype, birth.device)} " + _FIX["escape"],
                            locate=False)


_PUBLIC_MODULES = {"torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg",
                   "torch._C._special": "torch.special", "torch._C._fft": "torch.fft"}


def _api_name(func) -> str:
    """``Tensor.item``, ``torch.equal``, ``torch.nn.functional.linear``: from the
    function's own names (``torch.overrides.resolve_name`` costs seconds on first use)."""
    qualname = getattr(func, "__qualname__", None) or repr(func)
    owner, _, name = qualname.rpartition(".")
    if owner in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    if owner == "_VariableFunctionsClass":
        return f"torch.{name}"
    module = getattr(func, "__module__", None)
    return f"{_PUBLIC_MODULES.get(module, module)}.{qualname}" if module else qualname


def _stream_capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing: the stream its kernel goes to."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


def _dispatch(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if self.watch.eager:
        # Work that runs eagerly at every replay (``Detectors.eager``) makes no capture
        # hazard; what it returns is the segment's own (the model goes on with a break's
        # output), and no graph memory, so it cannot escape.
        out = func(*args, **kwargs)
        self.watch.made_eagerly(out)
        return out
    inputs = self.watch.before(func, args, kwargs)
    out = func(*args, **kwargs)
    self.watch.after(func, out, inputs)
    return out


class _DispatchMode(TorchDispatchMode):
    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch


class _DynamoSafeDispatchMode(_DispatchMode):
    """The mode while TorchDynamo is loaded: compiled code may run under it, and Dynamo
    must not trace the mode's own frames."""


# Torch wraps every mode's __torch_dispatch__ to keep Dynamo out of it, and that wrapper
# imports Dynamo on the first op (a second or more at start-up). Dynamo can only be
# tracing once it is imported, so the plain function serves until then.
_DispatchMode.__torch_dispatch__ = _dispatch
_DynamoSafeDispatchMode.__torch_dispatch__ = torch._disable_dynamo(_dispatch, recursive=True)


def _dispatch_mode(watch: _Watch) -> _DispatchMode:
    return (_DynamoSafeDispatchMode if "torch._dynamo" in sys.modules else _DispatchMode)(watch)


class _FunctionMode(TorchFunctionMode):
    """Names the Python call behind each op (``Tensor.item``), and catches reads of
    tensor values that bypass the dispatcher (``tolist`` and ``numpy`` on CPU)."""

    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        watch = self.watch
        watch.api = func
        host_read = watch.host_sync and func in _HOST_READ_APIS
        if host_read:
            watch.record(Check.HOST_SYNC, _api_name(func), _FIX["host_read"])
            watch.in_host_read = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            watch.api = None
            watch.in_host_read = False


def _sync_functions() -> list[tuple[object, str, str]]:
    """(owner, attribute, name) of each explicit synchronization in torch's Python API."""
    found = [(torch.cuda, "synchronize", "torch.cuda.synchronize"),
             (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"),
             (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize")]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        found.append((accelerator, "synchronize", "torch.accelerator.synchronize"))
    return found


_aside = threading.local()


@contextlib.contextmanager
def aside() -> Iterator[None]:
    """Work inside a watched segment that is not the segment's own code: torch.compile
    compiling, autotuning and running it (``graphflow.engine.model.compiled`` sets the dispatch
    modes aside too). Its synchronizations are not findings; a recompile while a stream
    captures is the JIT tripwires' to name."""
    _aside.depth = _set_aside() + 1
    try:
        yield
    finally:
        _aside.depth -= 1


def _set_aside() -> int:
    return getattr(_aside, "depth", 0)


def _patch_syncs(stack: contextlib.ExitStack, watch: _Watch) -> None:
    """Replace each synchronize with a wrapper that records a finding (on the watching
    thread, while the watch is open) and then synchronizes; ``stack`` restores them."""
    for owner, attribute, name in _sync_functions():
        own = vars(owner)
        had, saved = attribute in own, own.get(attribute)
        original = getattr(owner, attribute)

        def recording(*args, _original=original, _name=name, **kwargs):
            if watch.open and not watch.eager and not _set_aside() and threading.get_ident() == watch.thread:
                watch.record(Check.HOST_SYNC, _name, _FIX["sync"])
            return _original(*args, **kwargs)

        recording.__name__ = attribute
        recording.__qualname__ = getattr(original, "__qualname__", attribute)
        recording.__doc__ = getattr(original, "__doc__", None)
        setattr(owner, attribute, recording)
        if had:
            stack.callback(setattr, owner, attribute, saved)
        else:
            stack.callback(delattr, owner, attribute)


class Detectors:
    """Capture-safety checks around segment calls, and the findings they made.

    ``known`` are the tensors a segment may use without having created them: the
    plan's static buffers and the model's parameters and buffers (``add_known`` adds
    more). The engine calls ``watch`` around each graph segment call of warmup and
    capture, then reads ``findings`` (or ``report()``); eager segments may synchronize
    and are not watched. Findings repeat once: the same check, segment, call, message
    and phase is recorded once however many times it happens.
    """

    def __init__(self, checks: Iterable[Check] = Check.default(), known: Iterable[torch.Tensor] = ()):
        checks = frozenset(checks)
        for check in checks:
            if not isinstance(check, Check):
                raise TypeError(f"checks must be graphflow.engine.detectors.Check members (got {check!r})")
        self.checks = checks
        self.findings: list[Finding] = []
        self._seen: set[Finding] = set()
        self._known = _Known()
        self._known.add(known)
        self._kinds: dict[int, _OpKind] = {}  # id(op overload) -> kind; overloads live forever
        self._watch: _Watch | None = None  # the watch open now, for ``eager``

    def add_known(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors (and every view of their storage) as declared."""
        self._known.add(tensors)

    @contextlib.contextmanager
    def watch(self, segment: str, phase: Phase, capturing: bool,
              device: torch.device | str | None = None) -> Iterator[None]:
        """Check one segment call. ``capturing`` turns on ESCAPE and UNCAPTURED_KERNEL;
        ``device`` is the segment's device (CROSS_DEVICE compares against it; without
        it only mixed devices within one op are found).

        Never raises on its own: a failing op or user exception propagates unchanged,
        with the modes popped and torch's synchronize functions restored.
        """
        if not self.checks:
            yield
            return
        watch = _Watch(self, segment, phase, capturing, device)
        self._watch = watch
        try:
            with contextlib.ExitStack() as stack:
                if watch.host_sync:
                    _patch_syncs(stack, watch)
                stack.enter_context(_FunctionMode(watch))
                stack.enter_context(_dispatch_mode(watch))
                yield
        finally:
            watch.open = False
            self._watch = None
        if watch.escape:
            watch.check_escapes()

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Inside the segment being watched, work that runs eagerly at replay as well (a
        submodule a segment breaks at, ``graphflow.engine.model.split``): it runs unwatched, as
        an eager segment does (host reads, synchronization, kernels off the capture
        stream, tensors the plan does not know); what it makes counts as the segment's
        own; the graph pieces around it stay watched."""
        watch = self._watch
        if watch is None:
            yield
            return
        watch.eager += 1
        try:
            yield
        finally:
            watch.eager -= 1

    def clear(self) -> None:
        self.findings.clear()
        self._seen.clear()

    def report(self) -> str:
        """The findings grouped by segment, in the order first seen."""
        if not self.findings:
            return "no capture-safety findings"
        by_segment: dict[str, list[Finding]] = {}
        for finding in self.findings:
            by_segment.setdefault(finding.segment, []).append(finding)
        count = len(self.findings)
        lines = [f"{count} capture-safety finding{'s' if count != 1 else ''} "
                 f"in {len(by_segment)} segment{'s' if len(by_segment) != 1 else ''}:"]
        for segment, findings in by_segment.items():
            lines.append(f"segment {segment}:")
            for finding in findings:
                phase = f" [{finding.phase.value}]" if finding.phase is not None else ""
                lines.append(f"  {finding.check.value}{phase}: {finding.call}")
                lines.append(f"      {finding.message}")
        return "\n".join(lines)

    def _kind(self, func) -> _OpKind:
        kind = self._kinds.get(id(func))
        if kind is None:
            kind = self._kinds[id(func)] = _OpKind.of(func)
        return kind

    def _add(self, finding: Finding) -> None:
        if finding not in self._seen:
            self._seen.add(finding)
            self.findings.append(finding)
