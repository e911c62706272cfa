"""`fastpo dagger` (fastpo.sft.dagger, fastpo.sft.labels): the expert labels the states a model
reached (replayed, slips included), the conversations of the "own" and "expert" histories, the whole command on
a user game with an `expert()`, its resume (in a round's rollout and in its training), and
its bad input in one line.

Small real runs: random:tiny-llama (with the embedded SmolLM2 tokenizer), the tiny preset; a
scripted next-token table makes the model answer real moves where the labels are checked."""
import json
import os
import random
import re
import signal

import numpy as np
import pytest
import torch

import fastpo.sft.dagger
from fastpo.cli import main
from fastpo.config import RolloutConfig
from fastpo.config.imitation import DaggerConfig
from fastpo.sft.dagger import DaggerRoundTrainer, DaggerStopped
from fastpo.sft.labels import answer_content, jsonl, label_trajectories, labelled_conversations
from fastpo.rollout import MultiTurnRollout, NativeEngine
from run_helpers import ModelLoadReached
from scripted_logits import ScriptedLogits

MODEL = "random:tiny-llama"
MOVES = ("Left", "Down", "Right", "Up")


class Walk:
    """A user game with an expert: walk along cells 0..6 to the goal; a move slips (does
    nothing) one time in three, drawn from the game's own seeded stream."""

    instructions = "Walk to the goal."
    action_names = ("Left", "Right")
    settings = {"max_turns": 6, "max_actions_per_turn": 1, "max_actions_per_traj": 6}

    def reset(self, seed):
        self.rng = random.Random(seed)
        self.pos, self.goal = self.rng.sample(range(7), 2)
        return self._obs()

    def _obs(self):
        return f"You are at {self.pos}. The goal is at {self.goal}."

    def step(self, move):
        if self.rng.random() >= 1 / 3:
            self.pos = min(6, max(0, self.pos + (1 if move == "Right" else -1)))
        done = self.pos == self.goal
        return self._obs(), float(done), done, {"success": done}

    def expert(self):
        return "Right" if self.pos < self.goal else "Left"


class Drifty(Walk):
    """Not a function of its seed: every reset moves the goal (a replay cannot follow it)."""

    resets = 0

    def reset(self, seed):
        obs = super().reset(seed)
        Drifty.resets += 1
        self.goal = (self.goal + Drifty.resets) % 7
        return self._obs()


class NoExpert(Walk):
    expert = None


@pytest.fixture(scope="module")
def scripted(tiny):
    """(model, tokenizer, make_script(moves)): the tiny model answering one of `moves` after
    each `<answer>` prime, then `</answer>`."""
    model, tok = tiny

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    def make(moves):
        gt = ids("<answer>")[-1]
        first = tuple(ids(m + "</answer>")[0] for m in moves)
        close = ids("Left</answer>")[1:]  # "</", "answer", ">"
        assert all(ids(m + "</answer>")[1:] == close for m in moves) and close[-1] == gt
        table = {gt: first, **{f: close[0] for f in first}, close[0]: close[1], close[1]: close[2]}
        return ScriptedLogits(model, table, default=ids("<|im_end|>")[0])

    return model, tok, make


def _rollout(model, tok, env, options, seeds, max_turns=10):
    cfg = RolloutConfig(max_turns=max_turns, max_actions_per_traj=max_turns, max_actions_per_turn=1,
                        max_new_tokens=8, max_context=4096, think=False, temperature=1.0)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, env, options, cfg)
    with torch.no_grad():
        return ro, ro.generate(seeds, 1, seed=5)


def test_frozenlake_labels_are_the_optimal_moves_of_the_cells_the_model_reached(scripted):
    """Slippery FrozenLake, a model playing random moves: each turn's label is the optimal
    policy's move for the cell and actions left its user message shows (the coordinate lines,
    read here as an independent oracle), although the replay never reads them."""
    from fastpo.envs_native.frozenlake import FrozenLakeEnv

    model, tok, make = scripted
    script = make(MOVES)
    try:
        ro, batch = _rollout(model, tok, "frozenlake", {"observation": "coords", "is_slippery": True}, list(range(12)))
    finally:
        script.close()
    labels = label_trajectories(batch, ro)
    env = FrozenLakeEnv(12, observation="coords", is_slippery=True)
    env.reset(list(range(12)))
    policy = env.optimal_policy(10)
    cells, turns = set(), 0
    for b in range(12):
        assert len(labels[b]) == len(batch.response_texts[b]) == len(batch.user_messages[b])
        for k, user in enumerate(batch.user_messages[b]):
            (r, c), left = map(int, re.search(r"You \(P\) are at \((\d+), (\d+)\)", user).groups()), \
                int(re.search(r"You have (\d+) actions? left", user).group(1))
            assert labels[b][k] == f"<answer>{MOVES[policy[b, min(left, 10), r * 4 + c]]}</answer>", (b, k)
            cells.add((b, r, c))
            turns += 1
    assert turns > 40 and len(cells) > 24  # the model moved (and slipped) across many cells
    assert all(answer_content(t) in MOVES for texts in batch.response_texts for t in texts)


def test_a_user_game_s_expert_labels_the_states_the_model_reached(scripted):
    """A user game with its own seeded slips: the label of each turn is its expert() in the
    state the rollout showed; a game that is no function of its seed is refused."""
    model, tok, make = scripted
    script = make(("Left", "Right"))
    try:
        ro, batch = _rollout(model, tok, "test_dagger:Walk", {}, list(range(10)), max_turns=6)
        labels = label_trajectories(batch, ro)
        seen = set()
        for b in range(10):
            for k, user in enumerate(batch.user_messages[b]):
                pos, goal = map(int, re.search(r"You are at (\d+)\. The goal is at (\d+)\.", user).groups())
                assert labels[b][k] == "<answer>" + ("Right" if pos < goal else "Left") + "</answer>"
                seen.add((b, pos))
        assert len(seen) > 20 and sum(map(len, labels)) > 30
        ro, batch = _rollout(model, tok, "test_dagger:Drifty", {}, [0, 1], max_turns=6)
    finally:
        script.close()
    from fastpo.envs import EnvError

    with pytest.raises(EnvError, match="replaying the trajectory of seed 0 .* another state at turn 1"):
        label_trajectories(batch, ro)


@pytest.mark.parametrize("env, options, per_turn", [
    ("frozenlake", {"observation": "coords", "is_slippery": True}, 1),
    ("frozenlake", {"observation": "cells+coords", "is_slippery": False}, 1),
    ("bandit", {}, 1),
    ("sokoban", {}, 2),
])
def test_the_expert_s_own_trajectories_are_labelled_with_its_answers(env, options, per_turn):
    """Labelled by replay, the expert's own trajectories get its answers back (Sokoban: a
    shortest solution's first moves from each state, which may take another of equally short
    routes), and the conversations render to the tokens the rollout fed."""
    from fastpo.model_loading import load_tokenizer
    from fastpo.sft import chat_ids_and_mask, expert_rollout

    tok = load_tokenizer(MODEL)
    rcfg = RolloutConfig(max_turns=10, max_actions_per_traj=10, max_actions_per_turn=per_turn, max_context=4096,
                         think=False)
    seeds = list(range(40, 52))
    eb = expert_rollout(tok, env, options, rcfg, seeds, per_turn)
    ro = MultiTurnRollout(None, tok, env, options, rcfg)
    labels = label_trajectories(eb, ro, per_turn)
    answers = [[t.strip() for t in texts] for texts in eb.response_texts]
    rows, agree, turns = labelled_conversations(eb, labels, ro.chat.system_prompt, history="expert")
    assert turns == int(eb.num_turns.sum()) >= len(seeds)
    if env == "sokoban":
        for b in range(len(seeds)):  # a shortest solution's first moves, as many as the answer's
            assert [len(answer_content(x).split("||")) for x in labels[b]] == \
                [len(answer_content(x).split("||")) for x in answers[b]]
        assert agree >= turns // 2
        return
    assert labels == answers and agree == turns
    ids, mask = chat_ids_and_mask(tok, rows[0]["messages"])
    fed = eb.input_ids[0]
    assert torch.equal(ids[:len(fed)], fed)
    assert set(np.flatnonzero(eb.loss_mask[0].numpy())) <= set(np.flatnonzero(mask.numpy()))


def test_own_history_keeps_the_model_s_answers_as_context():
    from types import SimpleNamespace

    users = ["U1", "U2", "U3"]

    class B(SimpleNamespace):
        def __len__(self):
            return 1

    batch = B(user_messages=[users], response_texts=[["<answer>Right</answer>", " <answer>Down </answer>", "junk"]])
    labels = [["<answer>Left</answer>", "<answer>Down</answer>", None]]
    rows, agree, total = labelled_conversations(batch, labels, "S", history="own")
    assert (agree, total, len(rows)) == (1, 2, 2)  # "Down " is the label's move; the third turn has no label
    assert rows[1]["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "<answer>Right</answer>", "weight": 0},
        {"role": "user", "content": "U2"}, {"role": "assistant", "content": "<answer>Down</answer>"}]
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "<answer>Left</answer>"}
    rows = labelled_conversations(batch, labels, "S", history="own", per_trajectory=1, rng=np.random.default_rng(0))[0]
    assert len(rows) == 1
    rows = labelled_conversations(batch, labels, "S", history="expert")[0]
    assert len(rows) == 1 and [m["content"] for m in rows[0]["messages"][1:]] == [
        "U1", "<answer>Left</answer>", "U2", "<answer>Down</answer>"]  # cut before the unlabelled turn


def _run_args(out, *extra):
    return ["dagger", "--env", "test_dagger:Walk", "--preset", "tiny", "--model", MODEL, "--out", str(out),
            "--rounds", "1", "rollout.think=false", "trainer.iterations=2", "trainer.eval_every=0",
            "trainer.eval_before_training=false", "trainer.plots=false", "sft.trajectories=3", "sft.batch_size=2",
            "dagger.levels=4", "dagger.chunk=2", "dagger.turns_per_trajectory=1", "optim.actor_lr=1e-3", *extra]


def _weights(run):
    from safetensors.torch import load_file

    from fastpo.run.manifest import latest_checkpoint

    return load_file(os.path.join(latest_checkpoint(run), "model", "model.safetensors"))


def test_dagger_runs_rounds_and_a_stopped_run_continues_exactly(tmp_path, monkeypatch, capsys):
    """Round 0 (SFT on the expert), then a DAgger round. A run stopped by a signal in round 1's
    rollout keeps its finished chunk and continues with the same command; stopped in round 1's
    training it continues with --resume from its checkpoint; it ends with the data and weights
    of the run that was never stopped."""
    torch.set_num_threads(1)
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(_run_args(full)) == 0
    said = " ".join(capsys.readouterr().out.split())  # (rich wraps lines)
    assert f"the model: {full}/round-1" in said and "fastpo train --env test_dagger:Walk --model" in said
    data = [json.loads(x) for x in (full / "data" / "round-1.jsonl").read_text().splitlines()]
    summary = json.loads((full / "data" / "round-1.json").read_text())
    assert summary["levels"] == [0, 3] and summary["conversations"] == len(data) == 4  # one turn of each trajectory
    assert summary["labelled"] == summary["turns"] > 4  # every answered turn got its label
    for row in data:  # every target is the expert's move in the state its user message shows
        m = row["messages"]
        pos, goal = map(int, re.search(r"You are at (\d+)\. The goal is at (\d+)\.", m[-2]["content"]).groups())
        assert m[-1] == {"role": "assistant", "content": "<answer>" + ("Right" if pos < goal else "Left") + "</answer>"}
        assert all(x.get("weight") == 0 for x in m[2:-1:2])  # the model's own earlier answers: context
    assert [r["round"] for r in json.loads((full / "rounds.json").read_text())] == [0, 1]
    cfg1 = (full / "round-1" / "config.yaml").read_text()
    assert f"name: {full}/round-0" in cfg1 and "iterations: 2" in cfg1  # one epoch of 4 conversations, 2 a step

    real_label, real_iteration = fastpo.sft.dagger.label_trajectories, DaggerRoundTrainer.iteration
    calls = []

    def stop_in_second_chunk(batch, rollout, *a):  # a Ctrl-C while round 1's second chunk is rolled out
        calls.append(1)
        if len(calls) == 2:
            raise DaggerStopped(signal.SIGINT)
        return real_label(batch, rollout, *a)

    monkeypatch.setattr(fastpo.sft.dagger, "label_trajectories", stop_in_second_chunk)
    assert main(_run_args(part)) == 130
    said = " ".join(capsys.readouterr().out.split())
    assert f"1 of 2 chunks of 2 levels saved); continue with `fastpo dagger --resume {part}`" in said
    assert (part / "data" / "round-1.chunks" / "0000.jsonl").exists() and not (part / "data" / "round-1.json").exists()
    monkeypatch.setattr(fastpo.sft.dagger, "label_trajectories", real_label)

    def stop_in_round_1(self, it):  # a Ctrl-C during round 1's first step: it finishes, saves, exits 130
        m = real_iteration(self, it)
        if self.out.endswith("round-1") and it == 1:
            self.stop.request_stop(None, None)
        return m

    monkeypatch.setattr(DaggerRoundTrainer, "iteration", stop_in_round_1)
    assert main(_run_args(part)) == 130  # the same command continues (round 1's rollout from its second chunk)
    said = " ".join(capsys.readouterr().out.split())
    assert "continuing the run there" in said and "1 of 2 chunks already done" in said
    assert f"resume with `fastpo dagger --resume {part}`" in said
    monkeypatch.setattr(DaggerRoundTrainer, "iteration", real_iteration)
    assert main(["dagger", "--resume", str(part / "round-1")]) == 0  # a round's folder names its run
    assert "resumed" in capsys.readouterr().out
    assert (part / "data" / "round-1.jsonl").read_text() == (full / "data" / "round-1.jsonl").read_text()
    a, b = _weights(str(full / "round-1")), _weights(str(part / "round-1"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # done: the same command again has nothing to do
    assert main(_run_args(part)) == 0 and "nothing to do" in capsys.readouterr().out
    # StarPO's (and SFT's) resume of a DAgger folder is refused in one line naming the DAgger command
    for cmd in ("train", "sft"):
        assert main([cmd, "--resume", str(part)]) == 2
        err = capsys.readouterr().err.strip()
        assert "fastpo dagger --resume" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("bad,said", [
    (["dagger.rounds=0"], "dagger.rounds"),
    (["--rounds", "0"], "dagger.rounds"),
    (["dagger.history=mine"], "dagger.history"),
    (["dagger.levels=x"], "dagger.levels"),
    (["dagger.bogus=1"], "bogus"),
    (["dagger.seed_offset=999990"], "overlap the eval seeds"),
    (["dagger.expert_trajectories=300"], "more than the 256 levels"),
    (["sft.data=x.jsonl"], "sft.data"),
    (["sft.seed_offset=1000000"], "overlap the eval seeds"),
    (["--env", "test_dagger:NoExpert"], "has no expert"),
    (["--env", "bandit,sokoban"], "one game"),
    (["--trust-checkpoint"], "--trust-checkpoint"),
])
def test_bad_dagger_input_exits_2_with_one_line_before_the_model_loads(bad, said, capsys, no_model, tmp_path):
    args = ["dagger", "--env", "test_dagger:Walk", "--preset", "tiny", "--model", MODEL, "--out",
            str(tmp_path / "run")]
    if "--env" in bad:
        args[1:3] = []
    assert main([*args, *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastpo dagger: error:") and said in err and len(err.splitlines()) == 1, err


def test_a_folder_holding_another_run_or_other_settings_is_refused(capsys, no_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert main(["dagger", "--resume", str(run)]) == 2
    assert "not a `fastpo dagger` run folder" in capsys.readouterr().err
    # a DAgger run's settings, as its start writes them, then the same folder with another setting
    args = ["dagger", "--env", "test_dagger:Walk", "--preset", "tiny", "--model", MODEL, "--out", str(run)]
    cfg = fastpo.config.load_config(env="test_dagger:Walk", preset="tiny", sections=("sft", "dagger"), overrides=[
        *fastpo.sft.SFT_DEFAULT_OVERRIDES, f"model.name={MODEL}", f"trainer.output_dir={run}"])
    (run / "config.yaml").write_text(fastpo.config.files.dump_yaml(cfg))
    with pytest.raises(ModelLoadReached):  # the same settings: continued (more rounds are fine)
        main([*args, "--rounds", "5"])
    assert "continuing the run there" in capsys.readouterr().out
    assert main([*args, "dagger.levels=16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a DAgger run with other settings (dagger.levels=16 (the run's: 256))" in err
    assert main(["dagger", "--resume", str(run), "dagger.levels=16"]) == 2
    assert "cannot change on --resume" in capsys.readouterr().err


def test_a_round_s_data_adds_the_expert_s_trajectories_and_aggregates_the_rounds(tmp_path):
    """write_round: the chunks' conversations, then the expert's own trajectories on the
    round's first levels; with dagger.aggregate round k trains on rounds 1..k (one epoch of
    them), without it on its own."""
    from rich.console import Console

    from fastpo.config import load_config
    from fastpo.sft.dagger import DaggerRun

    cfg = load_config(env="test_dagger:Walk", preset="tiny", sections=("sft", "dagger"), overrides=[
        f"model.name={MODEL}", f"trainer.output_dir={tmp_path}", "rollout.think=false", "sft.batch_size=4",
        "dagger.levels=3", "dagger.expert_trajectories=2", "dagger.aggregate=true"])
    run = DaggerRun(cfg, Console(quiet=True))
    for k, n in ((1, 3), (2, 5)):
        part = tmp_path / "data" / f"round-{k}.chunks"
        part.mkdir(parents=True)
        rows = [{"messages": [{"role": "user", "content": f"r{k} {i}"}, {"role": "assistant", "content": "x"}]}
                for i in range(n)]
        (part / "0000.jsonl").write_text(jsonl(rows))
        (part / "0000.json").write_text(json.dumps({"trajectories": 3, "successes": 1, "turns": 9, "labelled": 9,
                                                    "agreed": 3, "conversations": n}))
        run.write_round(k, [[0, 1, 2]], str(part), 1.0)
        assert not part.exists()
    lines = [json.loads(x) for x in (tmp_path / "data" / "round-2.jsonl").read_text().splitlines()]
    assert len(lines) == 5 + 2 and lines[0]["messages"][0]["content"] == "r2 0"
    expert = lines[5:]  # the expert's trajectories on levels 3 and 4 (round 2's first), its answers as targets
    assert all(m["content"] in ("<answer>Left</answer>", "<answer>Right</answer>") and "weight" not in m
               for r in expert for m in r["messages"] if m["role"] == "assistant")
    s = json.loads((tmp_path / "data" / "round-2.json").read_text())
    assert (s["conversations"], s["expert_conversations"], s["agreement"], s["levels"]) == (7, 2, 1 / 3, [3, 5])
    data = run.collect(2)
    assert data["file"].endswith("rounds-1-2.jsonl") and data["conversations"] == 5 + 7
    assert open(data["file"]).read() == (tmp_path / "data" / "round-1.jsonl").read_text() + \
        (tmp_path / "data" / "round-2.jsonl").read_text()
    cfg2 = run.round_config(2, data)
    sft2 = cfg2.sft
    assert cfg2.trainer.iterations == 3 and sft2.batch_size == 4 and sft2.data == data["file"]  # ceil(12 / 4)
    assert cfg2.dagger is None  # a round is an ordinary SFT run
    assert cfg2.model.name == str(tmp_path / "round-1") and not cfg2.trainer.eval_before_training
    run.dag = DaggerConfig(levels=3)
    assert run.collect(2)["file"].endswith("round-2.jsonl") and run.collect(2)["conversations"] == 7
