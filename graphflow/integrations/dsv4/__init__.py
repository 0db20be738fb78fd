"""A small DeepSeek-V4-style decoder, with random weights, bound to graphflow by plans.

``plans/dsv4_mini_piecewise.yaml`` captures it PIECEWISE (eager attention between two
graphs a layer), ``plans/dsv4_mini_full.yaml`` FULL (static paged attention). See
docs/dsv4.md.
"""

from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.model import DSV4Model, build_model, expected_shapes

__all__ = ["DSV4Config", "DSV4Model", "build_model", "expected_shapes"]
