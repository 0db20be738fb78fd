"""The plugin's log: a child of vLLM's own logger, every line naming its rank.

vLLM configures only its ``vllm`` logger (its handler and format: level, time, process
name and pid, file and line) and stops it propagating, so a logger outside ``vllm.*``
prints nothing under ``vllm serve`` unless the user set logging up. As ``vllm.graphflow``
the plugin's lines go where vLLM's go, in vLLM's format, at ``VLLM_LOGGING_LEVEL``, and a
``VLLM_LOGGING_CONFIG_PATH`` that configures ``vllm`` configures them too.

vLLM's format names the process, not the rank: ``log`` starts each message with
``graphflow[rank N]``, the global rank once ``torch.distributed`` is up and ``-`` before
it (at plugin load), so ranks' lines can be told apart and sorted by their times.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

__all__ = ["LOGGER", "log"]

LOGGER = "vllm.graphflow"


class _RankedLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"graphflow[rank {_rank()}]: {msg}", kwargs


def _rank() -> str:
    """This process's global rank, read without importing torch (vLLM has imported it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return "-"


log = _RankedLog(logging.getLogger(LOGGER), {})
