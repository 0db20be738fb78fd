"""The model's size and cache geometry, in one frozen class.

The defaults are the mini model (seconds on a CPU); plans pass every field through
``model_args``, so a plan's buffer shapes and the model it builds are read side by side.
"""

from __future__ import annotations

import attrs

__all__ = ["DSV4Config"]

_DTYPES = ("float32", "bfloat16", "float16")
_RMS_KERNELS = ("cute", "triton", "torch")  # kernels.BACKENDS (config imports no torch)


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"'{attribute.name}' must be a positive int (got {value!r})")


@attrs.frozen(kw_only=True)
class DSV4Config:
    """A DeepSeek-V4-style decoder: hyper-connections, compressed-KV attention, MoE.

    Attention is MQA over a single latent per token (``kv_dim``, the absorbed-MLA decode
    form): every head's query lives in the latent space and the latent serves as key and
    value. Its first ``rope_dim`` channels carry the rotary position.
    """

    vocab_size: int = attrs.field(default=512, validator=_positive)
    hidden_size: int = attrs.field(default=64, validator=_positive)
    n_layers: int = attrs.field(default=4, validator=_positive)
    hc_streams: int = attrs.field(default=4, validator=_positive)  # hyper-connection residual streams
    n_heads: int = attrs.field(default=4, validator=_positive)
    kv_dim: int = attrs.field(default=32, validator=_positive)
    rope_dim: int = attrs.field(default=16, validator=_positive)
    n_experts: int = attrs.field(default=8, validator=_positive)
    top_k: int = attrs.field(default=2, validator=_positive)
    moe_inter: int = attrs.field(default=64, validator=_positive)
    shared_inter: int = attrs.field(default=128, validator=_positive)
    compress_every: int = attrs.field(default=4, validator=_positive)  # m: one compressed entry per m tokens
    max_len: int = attrs.field(default=128, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    max_batch: int = attrs.field(default=32, validator=_positive)
    sinkhorn_iters: int = attrs.field(default=20, validator=_positive)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(_DTYPES))
    # The RMSNorm kernel on CUDA (kernels.py): CuTe DSL, Triton or PyTorch's.
    rms_kernel: str = attrs.field(default="triton", validator=attrs.validators.in_(_RMS_KERNELS))
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        checks = (
            (self.top_k <= self.n_experts, f"top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})"),
            (self.rope_dim % 2 == 0 and self.rope_dim <= self.kv_dim,
             f"rope_dim ({self.rope_dim}) must be even and at most kv_dim ({self.kv_dim})"),
            (self.compress_every >= 2, f"compress_every ({self.compress_every}) must be at least 2"),
            (self.max_len % self.block_size == 0,
             f"max_len ({self.max_len}) must be a multiple of block_size ({self.block_size})"),
            (self.max_len % self.compress_every == 0,
             f"max_len ({self.max_len}) must be a multiple of compress_every ({self.compress_every})"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def blocks_per_seq(self) -> int:
        return self.max_len // self.block_size

    @property
    def num_blocks(self) -> int:
        """Pages in each layer's KV pool: every sequence can reach ``max_len``."""
        return self.max_batch * self.blocks_per_seq

    @property
    def max_compressed(self) -> int:
        return self.max_len // self.compress_every
