"""The capture engine: a phase pipeline with rollback, over a CUDA or CPU backend.

Lifecycle (``run_pipeline(plan, ...)``; each phase emits PHASE_BEGIN/END, and
DESCRIPTOR/REGION events inside it, to every listener; every segment call of warmup,
capture and verify, eager breaks of the verify replay included, is bracketed by
SEGMENT_BEGIN/END naming it, when there is a listener at all). Every phase runs under
``torch.no_grad()``: capture is for inference, and autograd would record every op and
refuse ``out=`` writes into buffers computed from weights that require grad.

1. **allocate** — map the plan's devices (the CPU backend maps ``cuda:N`` to ``cpu``);
   read each device's baseline memory; build the model (``factory(**model_args,
   **{k: v for k in (device, channels, rank, world_size, plan) if the factory accepts
   k})``) and bind it to the channels (``channels.bind(model)``, when they have a
   ``bind``, so a channel's prewarm hook resolves on it; unbound on rollback and
   close); resolve every segment's and prewarm hook's ``call`` path (digits index
   ModuleLists); create the plan's streams (plus one per device for segments naming
   none) and one capture pool per device; schedule the eager step and each region over
   their streams (``graphflow.engine.schedule``) and preallocate their events; allocate
   every static buffer once, at its largest size; set up the capture-safety detectors.
2. **warmup** — per descriptor, largest first, run the whole step eagerly
   ``warmup_iters`` times, each segment on its stream (the streams capture uses, forked
   and joined by events as in capture), each call watched by the detectors.
3. **prewarm** — run each declared prewarm hook once per specialization: with each
   descriptor size when ``per_size``, else once. No communication happens here.
4. **capture** — with the garbage collector frozen, PIECEWISE then FULL descriptors,
   largest first: each region is captured as one graph on its first segment's stream,
   its other streams forked from it and joined back, into its device's shared pool,
   every call watched by the detectors.
5. **verify** — per descriptor: fill inputs randomly (floats standard normal, ints from
   ``Buffer.values``), run the eager step, restore every read and state buffer, run the
   captured step program, and compare every written buffer: bit-exact unless the plan
   declares ``capture.verify`` tolerances. State buffers are left as they were.
6. **commit** — publish the step programs in an ``Engine`` for the runtime.

Any failure (an exception in a segment, a capture error, a detector finding, a verify
mismatch, a listener that raises, KeyboardInterrupt) unwinds the rollback stack, last in
first out, running every undo even when one raises: graphs destroyed, pools released,
no stream left capturing, gc unfrozen, buffers and model dropped, device memory back to
its baseline, listener-deferred undos (``Event.defer``) run. Then ``CaptureError``
(phase, descriptor, segment, rank, hint) is raised from the cause; failed undos are
added to it as a note and as ``undo_error`` (an ``ExceptionGroup``); KeyboardInterrupt
is re-raised itself.

Calling convention. A segment's callable is called as ``fn(*reads, *writes_not_in_reads)``:
its ``reads`` buffers in declared order, then its ``writes`` that are not also reads,
each a view of the static buffer at the current descriptor's batch size. Its return
value is ignored: a segment communicates only through its write buffers. Eager
segments get the same arguments. Events count descriptors 1-based (``index`` of
``total``).
"""

from graphflow.engine.backend import Backend, BackendKind, CpuBackend, CudaBackend, Graph, make_backend
from graphflow.engine.pipeline import Engine, Outcome, PhaseResult, PipelineReport, VerifyResult, run_pipeline
from graphflow.engine.rollback import UndoError, UndoStack

__all__ = [
    "Backend", "BackendKind", "CpuBackend", "CudaBackend", "Engine", "Graph", "Outcome", "PhaseResult",
    "PipelineReport", "UndoError", "UndoStack", "VerifyResult", "make_backend", "run_pipeline",
]
