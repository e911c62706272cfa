"""Multi-turn rollouts: prompts and parsing, the native engine (KV cache kept across turns,
group prefix sharing), the optional SGLang engine, and the token-in-token-out loop.

    from fastpo.rollout import RolloutConfig, NativeEngine, MultiTurnRollout
    engine = NativeEngine(model, tokenizer)
    rollout = MultiTurnRollout(engine, tokenizer, "frozenlake", {}, RolloutConfig(max_turns=5))
    batch = rollout.generate(seeds=[0, 1], group_size=4)     # a TrajectoryBatch of 8
"""
from fastpo.config.schema import RolloutConfig

from .trajectory_batch import TrajectoryBatch
from .engine import NativeEngine, TurnOutput
from .multiturn import MultiTurnRollout
from .parsing import ParsedResponse, parse_response
from .prompts import ChatFormat
from .sampling import SamplingParams, sample_tokens

__all__ = [
    "ChatFormat", "MultiTurnRollout", "NativeEngine", "ParsedResponse", "RolloutConfig", "SamplingParams",
    "TrajectoryBatch", "TurnOutput", "parse_response", "sample_tokens",
]
