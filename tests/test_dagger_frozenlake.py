"""tools/dagger_frozenlake.py: relabelling the expert's own FrozenLake trajectories gives back the
expert's answers (the state read from each user message, the move from the optimal-policy
table), the conversations render to the tokens the rollout fed, and a grid observation or a bad
argument gets one line."""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "dagger_frozenlake.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

from dagger_frozenlake import relabel, turn_state  # noqa: E402


@pytest.mark.parametrize("observation, slippery", [("coords", True), ("cells+coords", False)])
def test_relabelling_the_expert_gives_its_answers(observation, slippery):
    import torch

    from fastpo.config import RolloutConfig
    from fastpo.envs_native.frozenlake import FrozenLakeEnv
    from fastpo.models import load_tokenizer
    from fastpo.sft import chat_ids_and_mask, expert_rollout

    tok = load_tokenizer("smollm2-135m-instruct")
    options = {"observation": observation, "is_slippery": slippery}
    rcfg = RolloutConfig(max_turns=10, max_actions_per_traj=10, max_actions_per_turn=1, max_context=4096,
                         think=False)
    seeds = list(range(40, 52))
    eb = expert_rollout(tok, "frozenlake", options, rcfg, seeds, 1)
    env = FrozenLakeEnv(len(seeds), **options)
    env.reset(seeds)
    rows, agree, turns = relabel(eb, env.optimal_policy(10), env.action_names(0), env.size[1], 10, "SYSTEM")
    assert agree == turns
    assert sum(len(r["messages"]) // 2 for r in rows) == turns == int(eb.num_turns.sum()) > len(seeds)
    for b, r in enumerate(rows):
        assert [m["content"] for m in r["messages"][2::2]] == [t.strip() for t in eb.response_texts[b]]
    # with the rollout's own system prompt the chat renders to the tokens the rollout fed
    from fastpo.rollout import MultiTurnRollout

    system = MultiTurnRollout(None, tok, "frozenlake", options, rcfg).chat.system_prompt
    rows = relabel(eb, env.optimal_policy(10), env.action_names(0), env.size[1], 10, system)[0]
    ids, mask = chat_ids_and_mask(tok, rows[0]["messages"])
    fed = eb.input_ids[0]
    assert torch.equal(ids[:len(fed)], fed)
    assert set(np.flatnonzero(eb.loss_mask[0].numpy())) <= set(np.flatnonzero(mask.numpy()))


def test_turn_state_reads_the_coordinate_lines_only():
    assert turn_state("State:\nP_\n__\nYou (P) are at (0, 0).\nYou have 7 actions left.") == (0, 0, 7)
    assert turn_state("You (P) are at (3, 12).\nYou have 1 action left.") == (3, 12, 1)
    with pytest.raises(ValueError, match="no position"):
        turn_state("State:\nP_\n__\nYou have 7 actions left.")


@pytest.mark.parametrize("args, msg", [
    (["--model", "/nonexistent/run", "--out", "x.jsonl"], "dagger_frozenlake: "),
    (["--model", "m", "--seeds", "0", "--out", "x.jsonl"], "dagger_frozenlake: --seeds 0: must be >= 1"),
    (["--model", "m", "--chunk", "0", "--out", "x.jsonl"], "dagger_frozenlake: --chunk 0: must be >= 1"),
])
def test_bad_argument_is_one_line(args, msg):
    r = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, encoding="utf-8",
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith(msg) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_own_history_keeps_the_models_answers_as_context():
    from types import SimpleNamespace

    policy = np.zeros((1, 11, 16), dtype=np.int8)
    policy[0, 9, 1 * 4 + 2] = 3  # Up at (1, 2) with 9 actions left
    users = ["You (P) are at (0, 0).\nYou have 10 actions left.", "You (P) are at (1, 2).\nYou have 9 actions left."]
    names = ["Left", "Down", "Right", "Up"]

    class B(SimpleNamespace):
        def __len__(self):
            return 1

    batch = B(user_messages=[users], response_texts=[["<answer>Right</answer>", " <answer>Down</answer>"]])
    rows, agree, turns = relabel(batch, policy, names, 4, 10, "S", history="own")
    assert agree == 0 and turns == 2 and len(rows) == 2
    assert rows[1]["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": users[0]},
        {"role": "assistant", "content": "<answer>Right</answer>", "weight": 0},
        {"role": "user", "content": users[1]}, {"role": "assistant", "content": "<answer>Up</answer>"}]
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "<answer>Left</answer>"}
    rows = relabel(batch, policy, names, 4, 10, "S", history="own", per_trajectory=1,
                   rng=np.random.default_rng(0))[0]
    assert len(rows) == 1
    rows = relabel(batch, policy, names, 4, 10, "S")[0]
    assert [m["content"] for m in rows[0]["messages"][2::2]] == ["<answer>Left</answer>", "<answer>Up</answer>"]
