"""Several environments in one run (env.mixture): the entries and their errors, the weighted
draw of each env group's game, one engine batch over games with different limits, the
per-game metrics and evaluation, exact resume, `fastpo eval` of a mixture, two processes."""
from __future__ import annotations
import pathlib

import json
import math
import os

import numpy as np
import pytest
import torch
from rich.console import Console

from fastpo.cli import main as cli_main
from fastpo.config import ConfigError, load_config
from fastpo.seeds import eval_sampling_seed
from fastpo.config.members import env_members, member_rollout_config
from fastpo.envs import EnvError, EnvMember, MIXTURE, assign_members, parse_mixture
from fastpo.envs.mixture import member_index, shares
from fastpo.rollout.trajectory_batch import TrajectoryBatch
from run_helpers import records as _records, stable as _stable, train_one_and_two_processes


# --- the entries ----------------------------------------------------------------------------

def test_entries_parse_with_their_defaults():
    got = parse_mixture(["bandit", {"name": "sokoban", "weight": 2, "options": {"size": 6},
                                    "settings": {"max_turns": 8}, "label": "soko6"}])
    assert got == [EnvMember("bandit", "bandit", 1.0, {}, {}),
                   EnvMember("soko6", "sokoban", 2.0, {"size": 6}, {"max_turns": 8})]
    assert shares(got).tolist() == pytest.approx([1 / 3, 2 / 3])


@pytest.mark.parametrize("entries, message", [
    ([], "must be a non-empty list"),
    ("sokoban", "must be a non-empty list"),
    ([3], "env.mixture[0] = 3: must be a mapping"),
    ([{"weight": 2}], "env.mixture[0]: 'name' must name an environment"),
    ([{"name": "bandit", "wieght": 2}], "unknown key(s) ['wieght']"),
    ([{"name": "bandit", "weight": 0}], "weight = 0 must be a positive number"),
    ([{"name": "bandit", "weight": -1.5}], "weight = -1.5 must be a positive number"),
    ([{"name": "bandit", "weight": True}], "weight = True must be a positive number"),
    ([{"name": "bandit", "weight": float("nan")}], "weight = nan must be a positive number"),
    ([{"name": "bandit", "options": [1]}], "'options' must be a mapping"),
    ([{"name": "bandit", "settings": {"max_turn": 3}}], "unknown key(s) ['max_turn']"),
    ([{"name": "bandit", "settings": {"max_turns": 0}}], "settings['max_turns'] = 0 must be an integer >= 1"),
    (["bandit", {"name": "bandit"}], "label 'bandit' is also env.mixture[0]'s"),
    ([{"name": "bandit", "label": "a b"}], "label = 'a b' must be"),
])
def test_bad_entries_get_one_line_naming_them(entries, message):
    with pytest.raises(EnvError) as e:
        parse_mixture(entries)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (dict(env="bandit,nosuch"), "config key 'env.mixture': unknown environment 'nosuch'"),
    (dict(env="sokoban", overrides=["env.mixture=[bandit, frozenlake]"]), "config key 'env.name' = 'sokoban': is set "
                                                                          "beside env.mixture"),
    (dict(env="mixture"), "config key 'env.name' = 'mixture': names a mixture"),
    (dict(overrides=["env.mixture=[{name: frozenlake, options: {size: 1}}]"]), "'env.mixture' (frozenlake) options"),
    (dict(overrides=["env.mixture=[{name: bandit, weight: 0}]"]), "weight = 0 must be a positive number"),
    (dict(overrides=["env.mixture=[bandit, frozenlake]", "env.options.size=4"]), "config key 'env.options'"),
    (dict(overrides=["env.mixture=[{name: bandit, settings: {format_penalty: 1}}]"]), "entry 0 (bandit)"),
])
def test_bad_mixtures_are_refused_before_any_model_loads(args, message):
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", **args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_says_it_in_one_line_with_exit_2(tmp_path, capsys):
    assert cli_main(["train", "--env", "bandit,nosuch", "--preset", "tiny", "--out", str(tmp_path / "r")]) == 2
    assert cli_main(["sft", "--env", "bandit,sokoban", "--preset", "tiny", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown environment 'nosuch'" in err[0] and "fastpo sft trains on one game" in err[1]


def test_each_game_keeps_its_own_settings_over_the_runs():
    mix = "env.mixture=[bandit, {name: frozenlake, settings: {max_turns: 3, format_penalty: -0.5}}, sokoban]"
    cfg = load_config(preset="tiny", overrides=[mix])
    assert cfg.env.name == MIXTURE and cfg.trainer.output_dir == "runs/mixture"
    rc = {m.label: member_rollout_config(cfg, m) for m in env_members(cfg)}
    assert (rc["bandit"].max_turns, rc["bandit"].max_actions_per_traj) == (1, 1)  # the game's own single turn
    assert (rc["frozenlake"].max_turns, rc["frozenlake"].format_penalty) == (3, -0.5)  # the entry's
    assert rc["sokoban"].max_turns == 2 and rc["sokoban"].format_penalty == cfg.rollout.format_penalty  # the run's
    # the game's settings are written into its entry (config.yaml says what each game plays with)
    assert cfg.env.mixture[0] == {"name": "bandit", "settings": {"max_turns": 1, "max_actions_per_turn": 1,
                                                                  "max_actions_per_traj": 1}}
    # a rollout key the user sets beats a game's built-in setting, as for one game; an entry's beats both
    cfg = load_config(preset="tiny", overrides=[mix, "rollout.max_turns=4"])
    rc = {m.label: member_rollout_config(cfg, m) for m in env_members(cfg)}
    assert [rc[g].max_turns for g in ("bandit", "frozenlake", "sokoban")] == [4, 3, 4]
    assert rc["bandit"].max_actions_per_traj == 1
    # `--env a,b` is the same mixture at weight 1; `--env a` wins over a file's mixture
    assert [e["name"] for e in load_config(env="bandit,frozenlake", preset="tiny").env.mixture] == ["bandit",
                                                                                                 "frozenlake"]
    root = str(pathlib.Path(__file__).resolve().parents[2])
    one = load_config(env="frozenlake", file=os.path.join(root, "examples", "mixture.yaml"), preset="tiny")
    assert (one.env.name, one.env.mixture) == ("frozenlake", [])


def test_weights_as_written_in_yaml_and_huge_ones():
    got = parse_mixture([{"name": "bandit", "weight": "1e-3"}, {"name": "sokoban", "weight": "2.5E+2"}])
    assert [m.weight for m in got] == [1e-3, 250.0]  # YAML 1.1 reads 1e-3 as a string
    huge = parse_mixture([{"name": "bandit", "weight": 1.5e308}, {"name": "sokoban", "weight": 1.5e308}])
    assert shares(huge).tolist() == [0.5, 0.5]  # the sum overflows; the shares must not
    assert set(assign_members(range(100), huge)) == {0, 1}
    # a name a metric key cannot hold gets a label that can
    assert parse_mixture(["gym:fastpo/FrozenLake-v0"])[0].label == "gym:fastpo_FrozenLake-v0"


def test_groups_draw_their_game_by_weight_from_their_seed():
    members = parse_mixture([{"name": "bandit", "weight": 3}, "frozenlake"])
    seeds = list(range(4000))
    which = np.asarray(assign_members(seeds, members))
    assert abs(which.mean() - 0.25) < 0.03  # the second game's share: weight 1 of 4
    assert assign_members(seeds[:50], members) == which[:50].tolist()  # a function of the seed alone
    assert set(assign_members(seeds[:200], parse_mixture(["bandit"]))) == {0}
    assert member_index(7, [1.0, 1e-9]) == 0 and member_index(7, [1e-9, 1.0]) == 1


def test_concat_pads_the_turns_of_games_with_different_limits():
    def batch(turns):
        b = 2
        return TrajectoryBatch(
            input_ids=[torch.tensor([1, 2])] * b, loss_mask=[torch.tensor([False, True])] * b,
            sample_logprobs=[torch.zeros(2)] * b, turn_index=[torch.tensor([-1, 0])] * b,
            turn_rewards=torch.ones(b, turns), format_penalty=torch.zeros(b, turns),
            num_turns=torch.full((b,), turns), scores=torch.full((b,), float(turns)), success=torch.zeros(b, dtype=bool),
            num_actions=torch.ones(b, dtype=torch.long), group_ids=torch.zeros(b, dtype=torch.long),
            seeds=torch.zeros(b, dtype=torch.long), truncated=torch.zeros(b, dtype=bool), stop_reason=["x"] * b,
            responses=[[]] * b, response_texts=[[]] * b, metrics={}, env_labels=[f"g{turns}"] * b)

    both = TrajectoryBatch.concat([batch(1), batch(3)])
    assert both.turn_rewards.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert both.env_labels == ["g1", "g1", "g3", "g3"] and both.select([3, 0]).env_labels == ["g3", "g1"]


# --- the rollout ------------------------------------------------------------------------------

def _rollout(tiny, members):
    from fastpo.config import RolloutConfig
    from fastpo.rollout import MultiTurnRollout, NativeEngine

    model, tok = tiny
    shared = RolloutConfig(max_turns=2, max_new_tokens=6, max_context=2048, temperature=1.0)
    pairs = [(m, RolloutConfig(**{**shared.__dict__, **s})) for m, s in members]
    return MultiTurnRollout(NativeEngine(model, tok), tok, MIXTURE, {}, shared, members=pairs)


def test_one_batch_plays_every_game_under_its_own_limits(tiny):
    ro = _rollout(tiny, [(EnvMember("bandit", "bandit"), {"max_turns": 1, "max_actions_per_turn": 1,
                                                          "max_actions_per_traj": 1, "format_penalty": -0.3}),
                         (EnvMember("frozenlake", "frozenlake", options={"size": 4}), {"max_turns": 3})])
    seeds = list(range(10, 22))
    which = assign_members(seeds, [m for m, _ in ro.members])
    assert set(which) == {0, 1}  # both games drawn in this batch
    b = ro.generate(seeds, 2, seed=3, group_ids=list(range(len(seeds))))
    assert b.turn_rewards.shape == (24, 3) and b.info["envs"] == ["bandit", "frozenlake"]
    for i in range(len(b)):
        game = ["bandit", "frozenlake"][which[i // 2]]
        assert b.env_labels[i] == game
        assert int(b.num_turns[i]) <= (1 if game == "bandit" else 3)
        first = b.user_messages[i][0]
        assert ("bandit" in first.lower()) == (game == "bandit")
        if game == "bandit":  # the game's own format penalty (the random model never answers well)
            assert float(b.format_penalty[i, 0]) in (0.0, pytest.approx(-0.3))
    assert any(int(n) == 3 for n, g in zip(b.num_turns, b.env_labels) if g == "frozenlake")
    # a group plays the same trajectories as in a rollout of its game alone
    alone = ro.only("frozenlake")
    g = which.index(1)
    solo = alone.generate([seeds[g]], 2, seed=3, group_ids=[g])
    for j in range(2):
        assert torch.equal(b.input_ids[2 * g + j], solo.input_ids[j])
    with pytest.raises(KeyError, match="no env 'nosuch'"):
        ro.only("nosuch")


# --- training, evaluation, resume ---------------------------------------------------------------

MIX = ["env.mixture=[{name: bandit, weight: 2}, {name: frozenlake, settings: {max_turns: 3}}]",
       "model.name=random:tiny-llama", "rollout.env_groups=4", "algorithm.adv_estimator=grpo", "trainer.eval_seeds=3",
       "trainer.iterations=2", "trainer.eval_every=2", "trainer.save_every=1", "trainer.plots=false",
       "trainer.eval_before_training=true", "trainer.keep_checkpoints=1", "trainer.seed=1"]


def test_a_mixture_trains_evaluates_each_game_and_resumes_exactly(tmp_path):
    from fastpo.trainer import Trainer

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    Trainer(load_config(preset="tiny", overrides=[f"trainer.output_dir={a}", *MIX]), console=Console(quiet=True)).run()
    full = _records(a)
    last = full[-1]
    for g in ("bandit", "frozenlake"):
        for k in ("success_rate", "success_rate_se", "format_valid", "random_success", "optimal_success"):
            assert math.isfinite(last[f"eval/{g}/{k}"]), (g, k)
    w = {"bandit": 2 / 3, "frozenlake": 1 / 3}
    for k in ("success_rate", "score_mean", "random_success", "optimal_success"):  # the weighted whole
        assert last[f"eval/{k}"] == pytest.approx(sum(w[g] * last[f"eval/{g}/{k}"] for g in w))
    assert last["eval/score_mean_se"] == pytest.approx(math.sqrt(sum((w[g] * last[f"eval/{g}/score_mean_se"]) ** 2
                                                                     for g in w)))
    for r in full[1:]:
        assert r["train/bandit/share"] + r["train/frozenlake/share"] == pytest.approx(1.0)
    assert last["eval/frozenlake/num_turns"] <= 3 and last["eval/bandit/num_turns"] == 1
    outcomes = json.load(open(os.path.join(a, "eval", "iter_000002.json")))
    assert outcomes["env"] == ["bandit"] * 3 + ["frozenlake"] * 3 and sum(outcomes["weight"]) == pytest.approx(1.0)

    # stopped after iteration 1 and resumed: the same draws of games, the same run
    Trainer(load_config(preset="tiny", overrides=[f"trainer.output_dir={b}", *MIX]), console=Console(quiet=True),
            stop_after=1).run()
    assert cli_main(["train", "--resume", b]) == 0
    resumed = _records(b)
    assert [r["iteration"] for r in resumed] == [r["iteration"] for r in full]
    for ra, rb in zip(full, resumed):
        sa, sb = _stable(ra), _stable(rb)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sb[k] == (pytest.approx(sa[k], rel=1e-5, abs=1e-6) if isinstance(sa[k], float) else sa[k]), k
    from fastpo.report.summary import before_after

    rows = {r["label"]: r for r in before_after(full, a)["rows"]}  # the end-of-run table: a row per game
    assert {"success", "success (bandit)", "success (frozenlake)", "random policy (bandit)",
            "optimal policy (frozenlake)"} <= {k.strip() for k in rows}
    assert rows["success (bandit)"]["after"] == last["eval/bandit/success_rate"]

    # fastpo eval of the run evaluates each game with the run's settings
    js = str(tmp_path / "eval.json")
    assert cli_main(["eval", "--model", a, "--json", js]) == 0
    rep = json.load(open(js))
    assert rep["env"] == MIXTURE and len(rep["env_mixture"]) == 2
    for g in ("bandit", "frozenlake"):
        assert f"{g}/success_rate" in rep["metrics"] and f"{g}/random_success" in rep["metrics"]
    # the run's own evaluation repeated: its seeds and sampling seed, the same figures (issue 58 item 12)
    assert rep["eval"]["seeds"] == 3 and rep["eval"]["sampling_seed"] == eval_sampling_seed(1)
    for k in ("success_rate", "score_mean", "frozenlake/score_mean", "bandit/format_valid"):
        assert rep["metrics"][k] == pytest.approx(last[f"eval/{k}"]), k
    # on one of its games: that game's settings in the mixture (frozenlake: 3 turns)
    assert cli_main(["eval", "--model", a, "--env", "frozenlake", "--json", js]) == 0
    rep = json.load(open(js))
    assert rep["env"] == "frozenlake" and rep["rollout"]["max_turns"] == 3 and "success_rate" in rep["metrics"]


def test_paired_z_of_a_mixture_weighs_each_game():
    from fastpo.report.summary import _paired_z

    before = {"seed": [1, 2, 3, 1, 2, 3], "success_rate": [0, 0, 1, 0, 0, 0], "env": ["a"] * 3 + ["b"] * 3,
              "weight": [0.75 / 3] * 3 + [0.25 / 3] * 3}  # game a at weight 3, b at 1
    after = dict(before, success_rate=[1, 1, 1, 0, 1, 0])
    d_a, d_b = np.array([1, 1, 0.0]), np.array([0, 1, 0.0])
    se = math.sqrt(0.75 ** 2 * d_a.var(ddof=1) / 3 + 0.25 ** 2 * d_b.var(ddof=1) / 3)
    assert _paired_z(before, after, "eval/success_rate") == pytest.approx((0.75 * d_a.mean() + 0.25 * d_b.mean()) / se)
    assert _paired_z(before, after, "eval/a/success_rate") == pytest.approx(d_a.mean() / (d_a.std(ddof=1) / math.sqrt(3)))


def test_two_processes_play_the_same_games(tmp_path):
    """`--nproc 2`: each process rolls out its share of the env groups; every game's rollout
    and evaluation figures equal one process's (the engine's costs aside)."""
    # one iteration (later ones follow weights summed in another order); group sampling streams
    # (one process samples as two); a reward of the responses' parity so that scores differ
    one, two = train_one_and_two_processes(tmp_path, [
              "--env", "bandit,frozenlake", "--preset", "tiny", "--model", "random:tiny-llama", "rollout.env_groups=4",
              "trainer.eval_seeds=4", "trainer.progress=false", "trainer.plots=false", "algorithm.adv_estimator=grpo",
              "trainer.iterations=1", "trainer.eval_every=1", "rollout.sampling_streams=group",
              "reward.fn=run_helpers:response_parity", "trainer.seed=1"])  # seed 1: both games in iteration 1
    cost = ("seconds", "tokens_per_s", "prefilled_tokens", "peak_kv_bytes", "peak_kv_token_bytes")
    compared = 0
    for ra, rb in zip(one, two):
        for k, v in ra.items():
            if k.split("/")[0] in ("train", "eval") and k.count("/") == 2 and not k.endswith(cost):
                assert rb[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (ra["iteration"], k)
                compared += 1
    assert compared > 20 and len(one) == len(two) == 1
    assert one[0]["train/bandit/share"] not in (0.0, 1.0)  # both games drawn


def test_the_example_mixture_config_loads():
    root = str(pathlib.Path(__file__).resolve().parents[2])
    cfg = load_config(file=os.path.join(root, "examples", "mixture.yaml"), preset="tiny")
    assert [m.label for m in env_members(cfg)] == ["sokoban", "frozenlake", "bandit"]
    assert member_rollout_config(cfg, env_members(cfg)[1]).max_turns == 6


def test_per_game_results_reach_the_console_whole_without_an_evaluation_before_training(tmp_path, capsys):
    """Issue 58 item 14: with no evaluation before training (the tiny preset) only the whole
    mixture's success was printed, and a long label was cut ("heldback_nim…") in a log."""
    import io

    label = "heldback_frozenlake_game"
    out = str(tmp_path / "run")
    assert cli_main(["train", f"env.mixture=[{{name: bandit}}, {{name: frozenlake, label: {label}}}]",
                     "--preset", "tiny", "--model", "random:tiny-llama", "--out", out, "--iterations", "1",
                     "trainer.plots=false", "rollout.max_new_tokens=4"]) == 0
    said = capsys.readouterr().out
    last = _records(out)[-1]
    for g in ("bandit", label):
        line = next((x for x in said.splitlines() if x.startswith(f"  {g} (eval at iteration 1): success ")), None)
        assert line is not None, said[-2000:]
        assert f"success {last[f'eval/{g}/success_rate']:.3f}" in line and "random" in line and "optimal" in line
    # the before/after table in a log (80 columns by default): every label whole, a row per line
    from fastpo.report.summary import before_after_table, print_table

    rec0 = {**last, "iteration": 0}
    console = Console(file=io.StringIO(), width=80)
    print_table(console, before_after_table([rec0, last]))
    text = console.file.getvalue()
    assert f" optimal policy ({label}) " in text and "…" not in text and console.width == 80
