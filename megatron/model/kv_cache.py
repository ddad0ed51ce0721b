"""Keys and values of the tokens already seen, so incremental decoding runs attention for the new
tokens only. One `LayerKVCache` per transformer block; `KVCache` holds them for the whole model.

Shapes: B batch, G key/value heads (the query groups under GQA, else the attention heads),
L max length, S new tokens, D head dim.
"""

import torch

from megatron.errors import ConfigError


class LayerKVCache:
    """Preallocated [B, G, L, D] key and value buffers of one attention layer, filled left to right."""

    def __init__(self, keys_BGLD: torch.Tensor, values_BGLD: torch.Tensor) -> None:
        self.keys_BGLD = keys_BGLD
        self.values_BGLD = values_BGLD
        self.length = 0

    def append(self, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values; return those of every token so far."""
        start, stop = self.length, self.length + k_BGSD.shape[2]
        if stop > self.keys_BGLD.shape[2]:
            raise ConfigError(
                f"the KV cache holds {self.keys_BGLD.shape[2]} positions but {stop} were requested; "
                "build the cache with a larger max_length (at most the model's max position embeddings)"
            )
        self.keys_BGLD[:, :, start:stop] = k_BGSD
        self.values_BGLD[:, :, start:stop] = v_BGSD
        self.length = stop
        return self.keys_BGLD[:, :, :stop], self.values_BGLD[:, :, :stop]


class KVCache:
    """Every layer's cache, all at the same length: the position of the next token."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, kv_heads, max_length, head_dim)
        self.layers = [
            LayerKVCache(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.max_length = max_length

    @property
    def length(self) -> int:
        return self.layers[0].length
