"""vLLM integration: plans of what vLLM captures, and a plugin that makes capture safe.

* ``plan_from_vllm_config``: what vLLM 0.33 will capture, predicted from its config by
  vLLM's own rules (no vLLM needed), with what the prediction cannot know.
* ``plan_from_engine``: what a running engine will capture, read off its resolved
  descriptors (model runner V1's dispatcher, V2's graph managers).
* ``register``: the ``vllm.general_plugins`` entry point (``GRAPHFLOW_VLLM=1``): validate
  before capture, capture as a transaction, trace every custom all-reduce per rank behind
  store barriers, apply the warmup policies. See docs/vllm.md.

Importing this package imports neither vLLM nor torch.
"""

from graphflow.integrations.vllm.config import ATTENTION_SUPPORT, VLLM_MODES, plan_from_vllm_config
from graphflow.integrations.vllm.descriptors import VllmDescriptor, VllmPlan
from graphflow.integrations.vllm.engine import plan_from_engine
from graphflow.integrations.vllm.plugin import register, unregister

__all__ = ["ATTENTION_SUPPORT", "VLLM_MODES", "VllmDescriptor", "VllmPlan", "plan_from_engine",
           "plan_from_vllm_config", "register", "unregister"]
