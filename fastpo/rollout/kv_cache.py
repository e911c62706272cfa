"""The native engine's KV cache pieces: a transformers cache layer writing into preallocated
buffers (`BufferLayer`), which models the engine can hold (`unsupported_attention`: full
attention in every layer), the prompt prefix every env group shares (`shared_prefix_length`),
and the forward's cache keyword across transformers versions (`cache_kwarg`). The engine
itself and the KV layout are described in fastpo/rollout/engine.py."""
from __future__ import annotations

import inspect

from transformers.cache_utils import DynamicLayer

from fastpo.memory import mapped_allocations


def unsupported_attention(config) -> str | None:
    """Why a model config cannot run on the native engine, or None when every layer is full attention.

    Checks ``layer_types`` (transformers >= 4.5x: anything but "full_attention", e.g.
    "sliding_attention", "linear_attention"), else ``sliding_window`` (unless
    ``use_sliding_window`` is False), and ``attention_chunk_size``.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    if types:
        other = sorted({str(t) for t in types if t != "full_attention"})
        if other:
            return f"layer_types includes {other}"
    else:
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) is not False:
            return f"sliding_window={window!r}"
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None:
        return f"attention_chunk_size={chunk!r}"
    return None


#: Shortest common prompt prefix worth a forward of its own in `NativeEngine.start`.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(prompts: list) -> int:
    """Tokens at the start of every prompt that `NativeEngine.start` prefills once for all of them.

    prompts: lists of token ids. The longest common prefix, less one token if it is a whole
    prompt (every row keeps a token of its own, whose logits start its decoding); 0 for a single
    prompt or a prefix shorter than MIN_SHARED_PREFIX.
    """
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    S = 0
    while S < n and all(p[S] == first[S] for p in prompts):
        S += 1
    S = min(S, n - 1)
    return S if S >= MIN_SHARED_PREFIX else 0


class BufferLayer(DynamicLayer):
    """A KV cache layer writing into a preallocated buffer; the batch is rows [:rows]."""

    def __init__(self) -> None:
        super().__init__()
        self.kbuf = self.vbuf = None
        self.rows = 0
        self.length = 0
        self.capacity = 0
        self.is_initialized = True

    def bind(self, kbuf, vbuf, rows: int, length: int, capacity: int) -> None:
        self.kbuf, self.vbuf, self.rows, self.length, self.capacity = kbuf, vbuf, rows, length, capacity
        if kbuf is not None:
            self.device = kbuf.device
            self.keys = kbuf[:rows, :, :length]
            self.values = vbuf[:rows, :, :length]

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers come from bind()
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        if self.kbuf is None:  # first forward of a session set: allocate now that H and D are known
            R, H, _, D = key_states.shape
            with mapped_allocations():  # returned exactly when replaced (fastpo.memory)
                self.kbuf = key_states.new_zeros((R, H, self.capacity, D))
                self.vbuf = value_states.new_zeros((R, H, self.capacity, D))
            self.device = key_states.device
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV buffer overflow: {end} > capacity {self.capacity} (fastpo engine bug)")
        self.kbuf[: self.rows, :, self.length:end] = key_states
        self.vbuf[: self.rows, :, self.length:end] = value_states
        self.length = end
        self.keys = self.kbuf[: self.rows, :, :end]
        self.values = self.vbuf[: self.rows, :, :end]
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length


def cache_kwarg(model) -> str:
    """'cache' (transformers >= 5.2x) or 'past_key_values' (older), for the model's forward."""
    base = model
    for attr in ("get_base_model",):  # peft wrappers
        if hasattr(base, attr):
            base = getattr(base, attr)()
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
