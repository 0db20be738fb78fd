"""vLLM integration: capture plans from vLLM's compilation config.

Importing this package imports neither vLLM nor torch: ``plan_from_vllm_config`` reads
plain dicts as well as vLLM's config objects, so plans can be derived and validated
where vLLM is not installed.
"""

from graphflow.integrations.vllm.config import VLLM_MODES, plan_from_vllm_config

__all__ = ["VLLM_MODES", "plan_from_vllm_config"]
