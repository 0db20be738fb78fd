"""Integrations: graphflow inside other people's models and engines.

``dsv4``: a small DeepSeek-V4-style model with its plans. ``hf``: Hugging Face
``transformers`` models with a static KV cache the plan adopts. ``vllm``: plans of what
vLLM captures, and the ``vllm.general_plugins`` plugin. Each imports what it integrates
with only when used.
"""
