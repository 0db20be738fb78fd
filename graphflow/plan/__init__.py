"""The plan layer: what a model declares, checked before any GPU work. No torch.

``model``: the plan as small frozen attrs classes, its DAG and capture regions (its
names are this package's, ``from graphflow.plan.model import Plan, Buffer``). ``fields``: every
value check, the one home of what a field may hold. ``templates``: ``for_each`` and
``{name}`` expansion. ``loader``: YAML in and out, with line numbers for every element.
``decorators``: the same plan declared on a model's own classes. ``rules``: the rule
table ``graphflow.validate`` runs. ``schedule``: which segment waits for which across
streams, derived from the dataflow (the engine turns it into events). ``schema``: the
plan's JSON Schema, generated.
"""

from graphflow.plan.model import *  # noqa: F403 - the plan's names are the package's
from graphflow.plan.model import __all__  # noqa: F401
