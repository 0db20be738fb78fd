"""graphflow under transformers' continuous batching: the engine's scheduler, paged KV
cache and batching as they are, with graphflow capturing, verifying and replaying its
graphs (docs/serving.md).

* ``serving_plan(processor)``: the keys and adopted tensors, before any capture;
* ``serve(manager, lazy=...)``: graphflow in place of the engine's own capture;
* ``Coverage``: which steps ran on which graph, and why the others ran eagerly.
"""

from graphflow.integrations.hf.batching.coverage import Coverage, Fallback
from graphflow.integrations.hf.batching.keys import ServingKey, serving_keys
from graphflow.integrations.hf.batching.plan import ServingPlan, serving_plan
from graphflow.integrations.hf.batching.serving import Serving, serve

__all__ = ["Coverage", "Fallback", "Serving", "ServingKey", "ServingPlan", "serve", "serving_keys", "serving_plan"]
