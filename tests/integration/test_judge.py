"""The LLM judge (`reward.judge_rubric`, fastpo.judge): rubric checks and filling, verdict
parsing by hand, the judge on the embedded model and on a random one (batched equals one by
one; unparsed replies take the fallback and are counted), its score on the training batch, the
one-line errors before any model loads, and one training iteration judged by the embedded model."""
import pathlib
import os
import types

import pytest
import torch
from rich.console import Console

from fastpo.cli import main as cli_main
from fastpo.config import load_config
from fastpo.config.fields import ConfigError
from fastpo.judge import Judge
from fastpo.rubric import check_rubric, parse_verdict, read_rubric, render_rubric
from fastpo.model_loading import load_model_and_tokenizer
from fastpo.rewards import RewardFunction, Trajectory

YES_NO = "Is the following answer polite? Answer yes or no.\n\nAnswer: {answer}"


def _traj(responses, users=("Say hi",), seed=0):
    return Trajectory(env="demo", seed=seed, user_messages=list(users), responses=list(responses),
                      env_rewards=[0.0] * len(responses), format_penalty=[0.0] * len(responses), success=False,
                      stop_reason="env_done")


def test_a_rubric_needs_a_place_for_the_answer(tmp_path):
    with pytest.raises(ValueError, match=r"no place for the answer: put \{answer\}"):
        check_rubric("Is it good? Say yes or no.")
    f = tmp_path / "rubric.txt"
    f.write_text("Grade: {transcript}", encoding="utf-8")
    assert read_rubric(str(f)) == "Grade: {transcript}"
    f.write_text("Grade it.", encoding="utf-8")
    with pytest.raises(ValueError, match="no place for the answer"):
        read_rubric(str(f))
    with pytest.raises(ValueError, match="cannot read the rubric file"):
        read_rubric(str(tmp_path / "missing.txt"))


def test_rubric_placeholders_are_filled_once_and_other_braces_kept():
    t = _traj(["first {answer}", "last"], users=("the task", "obs 2"))
    text = render_rubric('{"json": 1} {env}: {task} | {answer} |\n{transcript}', t)
    assert text == ('{"json": 1} demo: the task | last |\n'
                    "User: the task\nAssistant: first {answer}\nUser: obs 2\nAssistant: last")


@pytest.mark.parametrize("reply,scale,expected", [
    ("Yes, it is polite.", "yes_no", 1.0), ("no.", "yes_no", 0.0), ("NO, because", "yes_no", 0.0),
    ("Nobody knows; yes", "yes_no", 1.0),  # whole words only: "Nobody" is no verdict
    ("I cannot say", "yes_no", None), ("Score: 7/10", "number", 0.7), ("10", "number", 1.0),
    ("-3", "number", None), ("11 out of 10", "number", None), ("about 2.5", "number", 0.25), ("none", "number", None),
    ("1e3", "number", None), ("1,000 points", "number", None), ("7.5/10", "number", 0.75), ("-0", "number", 0.0),
])
def test_verdicts_by_hand(reply, scale, expected):
    got = parse_verdict(reply, scale, 0.0, 10.0)
    assert got == (None if expected is None else pytest.approx(expected))


def test_the_embedded_model_judges_in_a_batch_as_one_by_one(embedded):
    """Greedy verdicts of SmolLM2-135M-Instruct on a yes/no rubric: each reply parses, and
    batching (with the rubric prefix prefilled once) gives the replies of one at a time."""
    model, tok = embedded
    trajs = [_traj([r], seed=i) for i, r in enumerate(["Hello, thank you very much!", "Shut up.", "Please sit down."])]
    batched = Judge(model, tok, YES_NO, max_new_tokens=3, batch_size=3).grade(trajs)
    single = Judge(model, tok, YES_NO, max_new_tokens=3, batch_size=1).grade(trajs)
    assert batched.replies == single.replies and all(batched.parsed), batched.replies
    assert set(batched.scores) <= {0.0, 1.0} and batched.too_long == 0 and batched.seconds > 0


def test_replies_without_a_verdict_take_the_fallback(tiny):
    """A random model's replies hold no number in range: the fallback score, counted; a prompt
    longer than the judge's context is not judged."""
    model, tok = tiny
    j = Judge(model, tok, "Rate from 0 to 10: {answer}", scale="number", fallback=0.25, max_new_tokens=4,
              max_context=64)
    v = j.grade([_traj(["short"]), _traj(["word " * 80])])
    assert v.too_long == 1 and v.replies[1] == "" and not v.parsed[1]
    for score, ok in zip(v.scores, v.parsed):
        assert score == (score if ok else 0.25) and 0.0 <= score <= 1.0


def test_the_judges_score_goes_on_the_last_turn(tiny):
    model, tok = tiny
    batch = types.SimpleNamespace(
        scores=torch.tensor([0.9, 0.0]), num_turns=torch.tensor([2, 1]),
        turn_rewards=torch.tensor([[-0.1, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        format_penalty=torch.tensor([[-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        seeds=torch.tensor([11, 12]), success=torch.tensor([True, False]), stop_reason=["env_done", "max_turns"],
        user_messages=[["task", "obs 1"], ["task"]], response_texts=[["no", "yes please"], ["nope"]])
    judge = Judge(model, tok, YES_NO, fallback=0.5, max_new_tokens=3)
    verdicts = judge.grade([_traj(["no", "yes please"], ("task", "obs 1")), _traj(["nope"], ("task",))])
    m = RewardFunction(None, "replace", "bandit", judge=judge).apply(batch)
    s0, s1 = verdicts.scores
    torch.testing.assert_close(batch.turn_rewards, torch.tensor([[-0.1, s0, 0.0], [s1, 0.0, 0.0]]))
    assert batch.scores.tolist() == pytest.approx([s0 - 0.1, s1])
    assert m["judge_score_sum"] == pytest.approx(s0 + s1) and m["count"] == 2.0 and m["judged"] == 2.0
    assert m["judge_unparsed"] == 2 - sum(verdicts.parsed)


@pytest.mark.parametrize("overrides,key,says", [
    (["reward.judge_rubric=Say yes or no."], "reward.judge_rubric", "no place for the answer"),
    (["reward.judge_rubric_file=/nonexistent/rubric.txt"], "reward.judge_rubric_file", "cannot read the rubric file"),
    (['reward.judge_rubric="Grade: {answer}"', "reward.judge_rubric_file=/x.txt"], "reward.judge_rubric_file",
     "give the rubric once"),
    (['reward.judge_rubric="Grade: {answer}"', "reward.judge_scale=number", "reward.judge_min=5", "reward.judge_max=5"],
     "reward.judge_max", "must be above reward.judge_min"),
    (['reward.judge_rubric="Grade: {answer}"', "reward.judge_scale=stars"], "reward.judge_scale", "stars"),
    (['reward.judge_rubric="Grade: {answer}"', "reward.judge_batch_size=0"], "reward.judge_batch_size", "must be >= 1"),
    (["reward.judge_model=random:tiny-llama"], "reward.judge_model", "no rubric is set"),
])
def test_bad_judge_settings_are_one_line_before_any_model_loads(overrides, key, says, capsys):
    with pytest.raises((ConfigError, ValueError), match=key) as e:
        load_config(env="bandit", preset="tiny", overrides=overrides)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert cli_main(["train", "--env", "bandit", "--preset", "tiny", *overrides]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_a_judge_model_that_names_nothing_is_refused_before_the_banner(tmp_path, capsys):
    assert cli_main(["train", "--env", "bandit", "--preset", "tiny", "--out", str(tmp_path / "r"),
                     'reward.judge_rubric="Grade: {answer}"', f"reward.judge_model={tmp_path / 'no_model'}"]) == 2
    captured = capsys.readouterr()
    assert "reward.judge_model=" in captured.err and "Traceback" not in captured.err
    assert not (tmp_path / "r").exists()


def test_one_iteration_judged_by_the_embedded_model(tmp_path):
    """End to end: Bandit with the random tiny policy (cheap) judged by the embedded model
    (reward.judge_model), the judge's score replacing the game's reward."""
    from fastpo.trainer import Trainer

    rubric = tmp_path / "rubric.txt"
    rubric.write_text(YES_NO, encoding="utf-8")
    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", f"reward.judge_rubric_file={rubric}",
        "reward.judge_model=smollm2-135m-instruct", "reward.mode=replace", "reward.judge_max_new_tokens=4",
        "trainer.iterations=1", "trainer.eval_every=0", "trainer.plots=false"])
    tr = Trainer(cfg, console=Console(quiet=True))
    rec = tr.run()[0]
    models = tr.parts.models
    assert models.judge.config.hidden_size != models.policy.config.hidden_size  # the embedded model judged
    assert 0.0 <= rec["train/judge_score_mean"] <= 1.0 and 0.0 <= rec["train/judge_unparsed_rate"] <= 1.0
    assert rec["time/judge_s"] > 0 and rec["train/judge_too_long"] == 0
    assert "train/reward_fn_mean" not in rec
    # the game's reward is gone: a score is the judge's (in [0, 1]) plus the format penalties
    assert rec["train/score_mean"] <= 1.0


def test_the_default_judge_is_a_frozen_copy_of_the_starting_weights(tiny):
    """reward.judge_model=null: the reference module when the run has one, else a frozen copy
    made before a checkpoint's weights load (a resumed run's judge is still the start)."""
    from fastpo.trainer.models import load_judge

    model, tok = tiny
    cfg = load_config(env="bandit", preset="tiny", overrides=['reward.judge_rubric="Grade: {answer}"'])
    judge, judge_tok = load_judge(cfg, model, tok, None, torch.device("cpu"), torch.float32)
    assert judge is not model and judge_tok is tok and not any(p.requires_grad for p in judge.parameters())
    for a, b in zip(judge.parameters(), model.parameters()):
        assert torch.equal(a, b)
    ref = object()
    assert load_judge(cfg, model, tok, ref, torch.device("cpu"), torch.float32)[0] is ref
    off = load_config(env="bandit", preset="tiny")
    assert load_judge(off, model, tok, None, torch.device("cpu"), torch.float32) == (None, None)


def test_a_trajectory_without_a_turn_is_not_judged(tiny):
    model, tok = tiny
    batch = types.SimpleNamespace(
        scores=torch.tensor([0.0, 0.0]), num_turns=torch.tensor([1, 0]), turn_rewards=torch.zeros(2, 2),
        format_penalty=torch.zeros(2, 2), seeds=torch.tensor([1, 2]), success=torch.tensor([False, False]),
        stop_reason=["max_turns", "context"], user_messages=[["task"], ["task"]], response_texts=[["a"], []])
    judge = Judge(model, tok, YES_NO, fallback=0.5, max_new_tokens=2)
    m = RewardFunction(None, "add", "bandit", judge=judge).apply(batch)
    assert m["judged"] == 1.0 and m["count"] == 2.0
    assert batch.turn_rewards[1].tolist() == [0.0, 0.0] and batch.scores[1] == 0.0


def test_the_rubric_file_is_kept_in_the_run_so_eval_and_resume_do_not_read_it(tmp_path):
    """config.yaml holds the rubric's text: with the file gone (or run from elsewhere),
    `fastpo eval` and `--resume` work; a file given on resume replaces the saved text."""
    from fastpo.config import load_run_config

    rubric = tmp_path / "rubric.txt"
    rubric.write_text(YES_NO, encoding="utf-8")
    run = tmp_path / "run"
    assert cli_main(["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--out", str(run),
                     f"reward.judge_rubric_file={rubric}", "reward.judge_max_new_tokens=2", "--iterations", "1",
                     "trainer.eval_every=0", "trainer.plots=false"]) == 0
    saved = load_run_config(str(run)).reward
    assert saved.judge_rubric == YES_NO and saved.judge_rubric_file is None
    rubric.unlink()
    assert cli_main(["eval", "--model", str(run), "--seeds", "2"]) == 0
    assert cli_main(["train", "--resume", str(run), "--iterations", "2"]) == 0
    other = tmp_path / "other.txt"
    other.write_text("Grade: {transcript}", encoding="utf-8")
    assert cli_main(["train", "--resume", str(run), "--iterations", "3", f"reward.judge_rubric_file={other}"]) == 0
    assert load_run_config(str(run)).reward.judge_rubric == "Grade: {transcript}"


def test_a_judge_model_the_engine_cannot_run_is_one_line(tiny, tmp_path, capsys):
    """A judge whose tokenizer has no chat template: exit 2, one line naming reward.judge_model
    (not a traceback from the engine)."""
    model, tok = tiny
    folder = tmp_path / "no_template"
    model.save_pretrained(folder)
    tok.chat_template = None
    try:
        tok.save_pretrained(folder)
    finally:
        tok.chat_template = load_model_and_tokenizer("random:tiny-llama")[1].chat_template
    assert cli_main(["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama",
                     "--out", str(tmp_path / "r"), 'reward.judge_rubric="Grade: {answer}"',
                     f"reward.judge_model={folder}", "trainer.plots=false"]) == 2
    err = capsys.readouterr().err
    assert "reward.judge_model=" in err and "chat template" in err and "Traceback" not in err


def test_final_placeholder_shows_the_state_after_the_last_move(tiny):
    """The transcript ends with the state before the last move; `{final}` is the game's state
    after it: a solved Sokoban level shows its box on the target there (no box left off one),
    which the transcript's last observation does not."""
    from fastpo.config import RolloutConfig
    from fastpo.rewards import trajectory_of
    from fastpo.sft import expert_rollout

    _, tok = tiny
    cfg = RolloutConfig(max_turns=10, max_actions_per_turn=1, max_actions_per_traj=10, max_new_tokens=16,
                        think=False, prompt_examples=True)
    batch = expert_rollout(tok, "sokoban", {}, cfg, list(range(8)), actions_per_turn=1)
    solved = [i for i in range(len(batch)) if bool(batch.success[i])]
    assert solved and len(batch.final_observations) == len(batch)
    seen = trajectory_of(batch, solved[0], "sokoban")
    final = render_rubric("{transcript}\nAfter the last move:\n{final}", seen).split("After the last move:\n")[1]
    assert final == batch.final_observations[solved[0]] and "X" not in final  # X: a box off its target
    assert "X" in seen.user_messages[-1]  # the last state the model saw still had it
    # select and concat carry it
    assert batch.select([solved[0]]).final_observations == [final]


def test_the_judged_free_text_example_trains(tmp_path, monkeypatch):
    """examples/polite_reply.yaml: a free-text game with no reward of its own, the judge's
    score replacing it; one iteration end to end (the random tiny model judging)."""
    from fastpo.trainer import Trainer

    root = str(pathlib.Path(__file__).resolve().parents[2])
    monkeypatch.chdir(root)  # the example names its game and rubric from the repository root
    cfg = load_config(file="examples/polite_reply.yaml", preset="tiny",
                      overrides=[f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama",
                                 "trainer.iterations=1", "trainer.plots=false"])
    assert cfg.reward.mode == "replace" and "{answer}" in cfg.reward.judge_rubric and cfg.rollout.max_turns == 1
    rec = Trainer(cfg, console=Console(quiet=True)).run()[-1]
    assert rec["train/judge_unparsed_rate"] == 1.0  # random weights give no verdict: the fallback, counted
    assert rec["train/score_mean"] == pytest.approx(cfg.reward.judge_fallback + rec["train/format_penalty_rate"]
                                                    * cfg.rollout.format_penalty)
