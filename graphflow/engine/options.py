"""How to run a pipeline: one frozen object, parsed once where the user speaks.

The CLI, a benchmark or a test builds ``RunOptions`` from its own arguments; the
pipeline only reads it. Names a user types (a backend, a check) become enums here, so a
typo fails before any model is built and nothing downstream compares strings.
"""

from __future__ import annotations

import enum
import pathlib
from collections.abc import Iterable

import attrs

from graphflow.engine.detectors import Check
from graphflow.engine.backend import BackendKind

__all__ = ["RunOptions", "Verify", "Watch", "check_named"]


class Watch(enum.Enum):
    """Which descriptors the capture-safety detectors watch.

    A hazard is in the code, not in a batch size: the first (largest) descriptor of each
    mode runs every segment the others run, so watching it finds what watching all of
    them would, at a fraction of the cost (the detectors slow each op several fold).
    """

    FIRST = "first"  # the first descriptor of each mode (the default)
    ALL = "all"  # every descriptor
    OFF = "off"


def _watch(value) -> Watch:
    if isinstance(value, bool):
        return Watch.FIRST if value else Watch.OFF
    return Watch(value)


class Verify(enum.Enum):
    """Which descriptors verify compares with the eager step before ready.

    Most broken captures are broken in the code (state outside the plan's buffers, a
    data-dependent path, an undeclared buffer), and what they break shows at every size:
    ``SAMPLE`` checks each mode's first and last descriptor in capture order and a few
    evenly spaced between, plus every descriptor the detectors watch, for a few seconds
    instead of one replay and compare per descriptor
    (``graphflow.engine.context.Context.verifies``); every other descriptor is checked on
    its first batch (``graphflow.engine.first_use``), so one wrong at a single size never
    serves. ``ALL`` checks every one before ready; ``OFF`` none, then or later.
    """

    SAMPLE = "sample"  # the default
    ALL = "all"
    OFF = "off"

    def __bool__(self) -> bool:
        # Whether the run verifies anything: what every check that only asks "verify or
        # not" (verify's inputs, its snapshots, its memory) needs to know.
        return self is not Verify.OFF

    @classmethod
    def of(cls, value: bool | str | Verify) -> Verify:
        """``value`` as a user gives it: ``True``/``False`` mean ``SAMPLE``/``OFF``, a
        name its member (``"all"``)."""
        if isinstance(value, bool):
            return cls.SAMPLE if value else cls.OFF
        return cls(value)


def check_named(name: str | Check) -> Check:
    """A detector check by its value (``host_sync``) or member name (``HOST_SYNC``)."""
    if isinstance(name, Check):
        return name
    for check in Check:
        if str(name).lower() in (check.value, check.name.lower()):
            return check
    raise ValueError(f"unknown check {name!r}: the checks are {', '.join(c.value for c in Check)}")


def _checks(names: Iterable[str | Check]) -> frozenset[Check]:
    return frozenset(check_named(n) for n in names)


def _sizes(sizes: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(sizes)


def _path(value) -> pathlib.Path | None:
    return None if value is None else pathlib.Path(value)


def _rule_codes(codes: Iterable[str]) -> frozenset[str]:
    from graphflow.plan.rules import RULES, unknown_codes

    codes = frozenset(codes)
    unknown = codes - {rule.code for rule in RULES}
    if unknown:
        raise ValueError(unknown_codes(unknown))
    return codes


@attrs.frozen
class RunOptions:
    """What ``run_pipeline`` does, apart from the plan and the model.

    ``backend``: ``auto`` (CUDA when a GPU is present, else the CPU backend), ``cuda`` or
    ``cpu``. ``verify``: compare replay with the eager step (``Verify``: a sample of
    the descriptors, all, or off; ``True``/``False`` mean sample/off). ``detectors``: watch graph
    segments for capture hazards (``Watch``: the first descriptor of each mode, all, or
    off; ``True``/``False`` mean first/off), except the ``disabled_checks``. ``sizes``: capture
    only these of the plan's descriptor sizes. ``seed``: verify's random inputs, so a
    mismatch can be rerun. ``skip_rules``: validation rule codes not to apply (a plan
    that reproduces a hazard on purpose, as a test of the runtime checks behind it);
    GF601 and GF604 are still refused in allocate, where nothing could capture them.
    ``lazy``: commit after the first descriptor's warmup and capture the rest in the
    background while the engine serves (``graphflow.engine.background``). ``compile``:
    apply the plan's ``torch.compile`` settings (False runs every segment uncompiled, to
    compare with the compiled capture; ``graphflow.engine.model.compiled``).
    """

    backend: BackendKind = attrs.field(default=BackendKind.AUTO, converter=BackendKind)
    verify: Verify = attrs.field(default=Verify.SAMPLE, converter=Verify.of)
    detectors: Watch = attrs.field(default=Watch.FIRST, converter=_watch)
    disabled_checks: frozenset[Check] = attrs.field(default=frozenset(), converter=_checks)
    sizes: tuple[int, ...] | None = attrs.field(default=None, converter=_sizes)
    seed: int = 0
    skip_rules: frozenset[str] = attrs.field(default=frozenset(), converter=_rule_codes)
    lazy: bool = False
    compile: bool = True
    save_graphs: pathlib.Path | None = attrs.field(default=None, converter=_path)
    graphs_from: pathlib.Path | None = attrs.field(default=None, converter=_path)
