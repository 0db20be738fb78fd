"""graphflow under transformers' continuous batching: the engine's scheduler, paged KV
cache and batching as they are, with graphflow capturing, verifying and replaying its
graphs (docs/serving.md).

* ``serving_plan(processor)``: the keys and adopted tensors, before any capture;
* ``serve(manager, lazy=...)``: graphflow in place of the engine's own capture;
* ``Coverage``: which steps ran on which graph, and why the others ran eagerly.

The names load on first use (``graphflow.exports``): the server's entry point
(``python -m graphflow.integrations.hf.batching.server``) is reached through this package
and says what it starts, or refuses its arguments, before torch loads.
"""

from graphflow.exports import lazy_names

#: Each name and its module.
_NAMES = {"Coverage": "coverage", "Fallback": "coverage", "ServingKey": "keys", "serving_keys": "keys",
          "ServingPlan": "plan", "serving_plan": "plan", "Serving": "serving", "serve": "serving"}

__all__ = sorted(_NAMES)
__getattr__ = lazy_names(__name__, _NAMES)
