"""Fixed generation scenarios of the native engine, for holding it to a recorded behaviour.

Each scenario drives `fastpo.rollout.NativeEngine` (or a `MultiTurnRollout` over it) through
its public interface only, with fixed prompts, appends and sampler seeds, and returns what
came out as plain JSON data (token ids, log-probs, entropies, values, stop reasons, session
lengths and contexts). `tests/integration/test_engine_recorded.py` compares the engine of the checkout
with `tests/data/engine_recorded.json`, which this module wrote from an earlier engine:

    python tests/engine_scenarios.py record tests/data/engine_recorded.json

(`--only tiny` records the tiny-model scenarios alone.) The file says which commit's engine
recorded it (and, where the sampler was newer than that engine, which commit's sampling module).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

TINY = "random:tiny-llama"
EMBEDDED = "smollm2-135m-instruct"


def _outs(outs) -> list:
    return [{"tokens": list(o.token_ids), "logprobs": [float(x) for x in o.logprobs],
             "entropies": [float(x) for x in o.entropies], "values": [float(x) for x in o.values],
             "stop": o.stop_reason} for o in outs]


def _prompts(tok) -> list:
    """Three env-group prompts that share a 40-token head (a system prompt) and differ after it."""
    head = list(range(300, 340))
    return [head + tok("A first group's state, short.", add_special_tokens=False)["input_ids"],
            head + tok("The second group's state is described at greater length here.",
                       add_special_tokens=False)["input_ids"],
            head + tok("Third.", add_special_tokens=False)["input_ids"]]


def _turns(engine, prompts, group_size, appends, params, generator, sessions_per_turn=None) -> dict:
    """start, then one generate per turn (appends[k] feeds turn k + 1); the sessions of turn k
    are sessions_per_turn[k] (default: all)."""
    B = len(prompts) * group_size
    engine.start(prompts, group_size)
    turns = []
    lengths = []
    for k in range(len(appends) + 1):
        sess = [s for s in range(B) if _open(engine, s)] if sessions_per_turn is None else sessions_per_turn[k]
        if not sess:
            break
        app = None if k == 0 else [appends[k - 1][s % len(appends[k - 1])] for s in sess]
        outs = engine.generate(sess, app, params, generator)
        turns.append({"sessions": sess, "outputs": _outs(outs)})
        lengths.append({str(s): engine.session_length(s) for s in sess if _open(engine, s)})
    engine.finish()
    return {"turns": turns, "lengths": lengths}


def _open(engine, s) -> bool:
    try:
        engine.session_length(s)
        return True
    except (KeyError, ValueError):
        return False


def tiny_scenarios(model, tok) -> dict:
    """The tiny random Llama: sampled and greedy, ragged stops, shared prefix, groups, a
    session left out, the context limit, per-group streams with top-k/top-p, a readout,
    evictions (context windows) and a rewind."""
    from fastpo.rollout import NativeEngine, SamplingParams

    V = int(model.get_input_embeddings().weight.shape[0])
    prompts = _prompts(tok)
    appends = [[[11, 12, 13], [14], [15, 16, 17, 18, 19], list(range(500, 530))],
               [[20], [21, 22], list(range(600, 611))]]
    out = {}
    eng = NativeEngine(model, tok)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=14, stop_token_ids=tuple(range(0, V, 7)), max_context=512)
    out["sampled"] = _turns(eng, prompts, 3, appends, sampled, torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=tuple(range(0, V, 5)), max_context=512)
    out["greedy"] = _turns(eng, prompts, 3, appends, greedy, torch.Generator().manual_seed(0))
    # sessions leaving: turn 2 continues only some; turn 3 fewer still
    out["leaving"] = _turns(eng, prompts, 3, appends, sampled, torch.Generator().manual_seed(3),
                            sessions_per_turn=[list(range(9)), [0, 2, 3, 5, 7, 8], [2, 7]])
    # the context limit: long prompts against a short max_context
    tight = SamplingParams(temperature=1.0, max_new_tokens=20, max_context=70)
    out["context"] = _turns(eng, prompts, 2, appends, tight, torch.Generator().manual_seed(4))
    # one stream per env group (evaluation's and distributed rollouts' sampler), top-k and top-p
    streams = [torch.Generator().manual_seed(10 + g) for g in range(3)]
    nucleus = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=9,
                             stop_token_ids=tuple(range(1, V, 4)), max_context=512)
    out["streams"] = _turns(eng, prompts, 2, appends, nucleus, {s: streams[s // 2] for s in range(6)})
    # a readout on the hidden states (the critic's values from the sampling pass)
    g = torch.Generator().manual_seed(5)
    H = int(model.config.hidden_size)
    w = torch.randn(H, generator=g)
    eng.readout = lambda h: h.float() @ w
    out["readout"] = _turns(eng, prompts, 2, appends, sampled, torch.Generator().manual_seed(6))
    eng.readout = None
    out["evict"] = _evictions(eng, prompts, sampled)
    return out


def _evictions(eng, prompts, params) -> dict:
    """Four turns with a context window of one turn (turn k's tokens dropped before turn k + 2),
    then a rewind of session 1 to its prompt and one more turn."""
    gen = torch.Generator().manual_seed(7)
    B = len(prompts) * 2
    eng.start(prompts, 2)
    sess = list(range(B))
    starts = {s: [len(prompts[s // 2])] for s in sess}  # position where each turn's tokens begin
    turns, contexts = [], []
    app = None
    for k in range(4):
        if k >= 2:
            for s in sess:
                eng.evict(s, starts[s][k - 2], starts[s][k - 1])
        outs = eng.generate(sess, app, params, gen)
        turns.append({"sessions": sess, "outputs": _outs(outs)})
        app = [[40 + k, 41 + k, 42 + s] for s in sess]
        for s in sess:
            starts[s].append(eng.session_length(s))
        contexts.append({str(s): [list(x) for x in eng.session_context(s)] for s in sess})
    eng.rewind(1, len(prompts[0]))
    outs = eng.generate(sess, [[9, 8, 7]] * B, params, gen)
    turns.append({"sessions": sess, "outputs": _outs(outs)})
    contexts.append({str(s): [list(x) for x in eng.session_context(s)] for s in sess})
    eng.finish()
    return {"turns": turns, "contexts": contexts}


def embedded_scenarios(model, tok) -> dict:
    """The embedded SmolLM2: a Sokoban rollout of 2 env groups x 2 trajectories, 2 turns, 16 new
    tokens per turn, greedy and sampled (temperature 0.7, sampler seed 3)."""
    from fastpo.rollout import MultiTurnRollout, NativeEngine, RolloutConfig

    cfg = RolloutConfig(max_turns=2, max_new_tokens=16, max_context=1536, think=False, prompt_examples=True)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, "sokoban", {}, cfg)
    out = {}
    for name, kw in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.7, seed=3))):
        batch = ro.generate([11, 12], 2, **kw)
        out[name] = {"input_ids": [x.tolist() for x in batch.input_ids],
                     "logprobs": [x.tolist() for x in batch.sample_logprobs],
                     "stops": batch.turn_stop_reasons, "success": batch.success.tolist()}
    return out


def record(path: str, only: str | None = None) -> None:
    from fastpo.model_loading import load_model_and_tokenizer

    torch.manual_seed(0)
    data = {"commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                     cwd=Path(__file__).parent).stdout.strip(),
            "threads": torch.get_num_threads()}
    model, tok, _ = load_model_and_tokenizer(TINY, seed=0)
    data["tiny"] = tiny_scenarios(model, tok)
    if only != "tiny":
        model, tok, _ = load_model_and_tokenizer(EMBEDDED)
        data["embedded"] = embedded_scenarios(model, tok)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "record":
        sys.exit("usage: python tests/engine_scenarios.py record PATH [--only tiny]")
    record(sys.argv[2], "tiny" if "--only" in sys.argv else None)
