"""The end-of-run evaluation report: standard errors, the format-valid rate, the before/after
table, the eval figure, and the answer-only prompt with examples (rollout.prompt_examples)."""
import math

import numpy as np
import pytest
import torch

from fastpo.config import load_config
from fastpo.evaluation.policy import format_valid_per_trajectory
from fastpo.report.plots import plot_curves
from fastpo.report.stats import standard_error
from fastpo.report.summary import before_after, before_after_table, result_line
from fastpo.rollout.parsing import parse_response
from fastpo.rollout.prompts import first_user_message, move_question, next_user_message


def test_standard_error_is_sample_std_over_root_n():
    x = [0.0, 1.0, 1.0, 0.0, 1.0]
    assert standard_error(x) == pytest.approx(np.std(x, ddof=1) / math.sqrt(5))
    assert standard_error([0.3]) == 0.0 and standard_error([]) == 0.0


def _penalised(penalty: float, penalised):
    """Three trajectories of 3, 2 and 0 turns, `penalised` turns each got `penalty`."""
    from fastpo.rollout.trajectory_batch import TrajectoryBatch

    b = len(penalised)
    fp = torch.zeros(b, 3)
    for i, n in enumerate(penalised):
        fp[i, :n] = penalty
    return TrajectoryBatch(
        input_ids=[torch.tensor([1, 2])] * b, loss_mask=[torch.tensor([False, True])] * b,
        sample_logprobs=[torch.zeros(2)] * b, turn_index=[torch.tensor([-1, 0])] * b, turn_rewards=fp.clone(),
        format_penalty=fp, num_turns=torch.tensor([3, 2, 0]), scores=fp.sum(1), success=torch.zeros(b, dtype=torch.bool),
        num_actions=torch.zeros(b, dtype=torch.long), group_ids=torch.arange(b), seeds=torch.arange(b),
        truncated=torch.zeros(b, dtype=torch.bool), stop_reason=["x"] * b, responses=[[]] * b,
        response_texts=[[]] * b, metrics={}, penalised_turns=torch.tensor(penalised))


def test_format_valid_per_trajectory_counts_unpenalised_turns():
    assert format_valid_per_trajectory(_penalised(-0.1, [1, 2, 0])).tolist() == pytest.approx([2 / 3, 0.0, 1.0])


def test_format_valid_counts_malformed_turns_when_the_penalty_is_zero():
    """A game or config with format_penalty 0 (the probe games') still has malformed turns: they
    were counted from a non-zero penalty, so every malformed turn read as valid (format-valid 1.0
    for a random model that never closed an answer)."""
    from fastpo.report.metrics import rollout_metrics

    batch = _penalised(0.0, [1, 2, 0])
    assert format_valid_per_trajectory(batch).tolist() == pytest.approx([2 / 3, 0.0, 1.0])
    m = rollout_metrics(batch, prefix="train")
    assert m["train/format_valid"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert m["train/format_penalty_rate"] == pytest.approx(1 - (2 / 3 + 0 + 1) / 3)


def _records():
    return [
        {"iteration": 0, "eval/success_rate": 0.10, "eval/success_rate_se": 0.03, "eval/format_valid": 0.5,
         "eval/format_valid_se": 0.04, "eval/score_mean": -0.1, "eval/score_mean_se": 0.02,
         "eval/random_success": 0.22, "eval/optimal_success": 0.52, "eval/num_seeds": 64},
        {"iteration": 1, "train/success_rate": 0.2, "train/format_valid": 0.7, "train/score_mean": 0.0},
        {"iteration": 2, "train/success_rate": 0.3, "train/format_valid": 0.9, "train/score_mean": 0.2,
         "eval/success_rate": 0.20, "eval/success_rate_se": 0.04, "eval/format_valid": 0.95,
         "eval/format_valid_se": 0.01, "eval/score_mean": 0.15, "eval/score_mean_se": 0.03,
         "eval/random_success": 0.22, "eval/optimal_success": 0.52, "eval/num_seeds": 64},
    ]


def test_before_after_compares_first_and_last_eval_in_standard_errors():
    ba = before_after(_records())
    assert (ba["before"], ba["after"]) == (0, 2)
    rows = {r["key"]: r for r in ba["rows"]}
    assert rows["eval/success_rate"]["change"] == pytest.approx(0.10)
    assert rows["eval/success_rate"]["z"] == pytest.approx(0.10 / 0.05)
    assert rows["eval/score_mean"]["z"] == pytest.approx(0.25 / math.hypot(0.02, 0.03))
    assert rows["eval/random_success"]["z"] is None and rows["eval/optimal_success"]["after"] == 0.52
    assert before_after(_records()[:2]) is None and before_after_table(_records()[1:]) is None
    assert before_after_table(_records()).row_count == 5


def test_result_line_says_where_success_stands_against_the_random_policy():
    recs = _records()  # after: 0.20 +- 0.04 against random 0.22
    line = result_line(recs)
    assert line.startswith("result (eval at iteration 2): success 0.200 +- 0.040 is within 2 SE of the random "
                           "policy's 0.220, not shown above random play (z -0.5; on the same seeds, optimal 0.520)")
    # success rose by exactly 2 SE: not "more than"; format-valid and score mean did
    assert "rose by more than 2 SE since iteration 0: format-valid +0.450 (z +10.9), score mean +0.250 (z +6.9)" \
        in line and "success +" not in line and "fell" not in line
    recs[2]["eval/success_rate"] = 0.40
    line = result_line(recs)
    assert "is above the random policy's 0.220 by more than 2 SE (z +4.5;" in line
    assert "success +0.300 (z +6.0)" in line
    recs[0]["eval/success_rate"], recs[2]["eval/success_rate"], recs[2]["eval/success_rate_se"] = 0.3, 0.05, 0.02
    line = result_line(recs)
    assert "is below the random policy's 0.220 by more than 2 SE (z -8.5;" in line
    assert "fell by more than 2 SE since iteration 0: success -0.250 (z -6.9)" in line
    recs[2]["eval/success_rate"], recs[2]["eval/success_rate_se"] = 1.0, 0.0  # every seed solved
    assert "is above the random policy's 0.220 (no SE: every seed the same;" in result_line(recs)
    del recs[2]["eval/success_rate_se"]
    assert "success 1.000 is above the random policy's 0.220 (no SE: none recorded;" in result_line(recs)
    for r in recs:  # a game without reference lines: says so, compares nothing to random
        r.pop("eval/random_success", None), r.pop("eval/optimal_success", None)
    assert "(no random-policy line in this evaluation)" in result_line(recs)
    assert result_line(recs[:2]) is None  # no evaluation after training
    assert result_line(recs[1:]).endswith("success 1.000 (no random-policy line in this evaluation)")  # no "before"
    # every seed moved alike (both SEs 0): a change of 1.0 is named, not "nothing changed"
    recs[0].update({"eval/format_valid": 0.0, "eval/format_valid_se": 0.0})
    recs[2].update({"eval/format_valid": 1.0, "eval/format_valid_se": 0.0})
    assert "rose by more than 2 SE since iteration 0: format-valid +1.000 (SE 0)" in result_line(recs)
    # judged as printed: z 2.04 prints +2.0, "within"; 1.96 too; 2.06 prints +2.1, "above"
    for s_after, word in ((0.302, "within 2 SE"), (0.298, "within 2 SE"), (0.303, "above")):
        recs[2].update({"eval/success_rate": s_after, "eval/success_rate_se": 0.05, "eval/random_success": 0.2})
        assert f"success {s_after:.3f} +- 0.050 is {word}" in result_line(recs)


def test_eval_figure_has_the_reference_lines(tmp_path):
    paths = plot_curves(_records(), str(tmp_path))
    assert str(tmp_path / "eval.png") in paths and (tmp_path / "eval.png").stat().st_size > 1000


def test_move_question_builds_answers_from_the_games_actions():
    q = move_question(["Left", "Down", "Right", "Up"], 5)
    answers = [a for a in q.split("<answer>")[1:]]
    assert len(answers) == 3
    for a in answers:
        parsed = parse_response("<answer>" + a.split("</answer>")[0] + "</answer>", think=False)
        assert parsed.format_ok and all(x.strip() in ("Left", "Down", "Right", "Up") for x in parsed.answer.split("||"))
    assert q.count("||") == 3  # one, two and three actions
    one = move_question(["A", "B"], 1)
    assert "||" not in one and "<answer>A</answer>" in one and "<answer>B</answer>" in one
    assert move_question(["Up", "Down", "Left", "Right"], 2).count("||") == 2  # at most 2 per answer


def test_question_replaces_the_reminder_in_every_message():
    q = move_question(["Left", "Down", "Right", "Up"], 5)
    first = first_user_message("Rules.", "P_\n_G", 10, 5, False, 16, ["Left", "Down", "Right", "Up"], question=q)
    nxt = next_user_message(2, 0.0, "_P\n_G", 8, False, 16, question=q)
    for m in (first, nxt):
        assert m.endswith(q) and "[your answer]" not in m
    plain = next_user_message(2, 0.0, "_P\n_G", 8, False, 16)
    assert "[your answer]" in plain and q not in plain


def test_prompt_examples_apply_in_answer_only_mode():
    c = load_config(env="frozenlake", preset="cpu", overrides=["rollout.think=true"])  # allowed: no effect
    assert c.rollout.prompt_examples and c.rollout.think
    c = load_config(env="frozenlake", preset="paper")
    assert not c.rollout.prompt_examples


def test_before_after_pairs_by_seed_when_the_outcomes_are_there(tmp_path):
    import json

    (tmp_path / "eval").mkdir()
    before = {"seed": [1, 2, 3, 4], "success_rate": [0, 0, 1, 0], "score_mean": [-0.1, 0, 1, 0],
              "format_valid": [0.5, 1, 1, 1]}
    after = {"seed": [1, 2, 3, 4], "success_rate": [1, 0, 1, 1], "score_mean": [1, 0, 1, 1],
             "format_valid": [1, 1, 1, 1]}
    (tmp_path / "eval" / "iter_000000.json").write_text(json.dumps(before))
    (tmp_path / "eval" / "iter_000002.json").write_text(json.dumps(after))
    rows = {r["key"]: r for r in before_after(_records(), run_dir=str(tmp_path))["rows"]}
    d = np.array([1, 0, 0, 1.0])
    assert rows["eval/success_rate"]["z_paired"] == pytest.approx(d.mean() / (d.std(ddof=1) / 2))
    assert rows["eval/random_success"]["z_paired"] is None
    # the result line judges the changes by the paired test where there is one (all under 2 here;
    # the independent z calls format-valid +10.9)
    assert result_line(_records(), run_dir=str(tmp_path)).endswith("nothing changed by more than 2 SE since "
                                                                   "iteration 0")
    after["seed"] = [1, 2, 3, 5]  # other seeds: no pairing
    (tmp_path / "eval" / "iter_000002.json").write_text(json.dumps(after))
    assert all(r["z_paired"] is None for r in before_after(_records(), run_dir=str(tmp_path))["rows"])
    assert before_after_table(_records(), run_dir=str(tmp_path)).row_count == 5
