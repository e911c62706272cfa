"""Paper fidelity (issue 10): what a run reports and computes against values worked out by
hand or by plain Python here. The environment-level checks (RAGEN's FrozenLake maps, the
success bounds) live in the test_envs_* files."""
import numpy as np
import pytest
import torch
from rich.console import Console

from fastpo.config import load_config
from fastpo.config.presets import PRESETS
from fastpo.envs_native import make_native_env
from fastpo.kernels import linear_policy_loss
from fastpo.distributed.context import SINGLE
from fastpo.trainer import Trainer
from fastpo.trainer.update import epoch_mini_batches


def test_trainer_eval_reports_the_ceiling_and_floor_on_its_seeds_and_horizon(tmp_path):
    # 2 turns x 3 actions = 6, capped by 5 actions per trajectory: the horizon is 5
    cfg = load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "trainer.plots=false",
        "rollout.max_turns=2", "rollout.max_actions_per_turn=3", "rollout.max_actions_per_traj=5",
        "rollout.max_new_tokens=4", "trainer.eval_seeds=6", "trainer.eval_seed_offset=300"])
    tr = Trainer(cfg, console=Console(quiet=True))
    tr.setup()
    res = tr.evaluate(0)
    seeds = list(range(300, 306))
    env = make_native_env("frozenlake", 1)
    assert res["eval/optimal_success"] == pytest.approx(env.optimal_success(seeds, 5).mean(), abs=1e-12)
    assert res["eval/random_success"] == pytest.approx(env.random_success(seeds, 5).mean(), abs=1e-12)
    assert res["eval/optimal_success"] != pytest.approx(env.optimal_success(seeds, 6).mean())  # not 6 actions
    assert 0 <= res["eval/random_success"] < res["eval/optimal_success"] <= 1
    assert tr.evaluate(1)["eval/optimal_success"] == res["eval/optimal_success"]  # the same each time


# The hand example: four trajectories of 4, 4, 40 and 200 trained tokens, advantages
# +1, +1, -1, -1, at the first PPO step (ratio 1, no clipping, no entropy term). Each token's
# loss is -A. The paper's (1/G) sum_i (1/|tau_i|) sum_t: (-1 - 1 + 1 + 1) / 4 = 0.0.
# token-mean over the mini-batch: (-4 - 4 + 40 + 200) / 248 = 232 / 248 = 0.935.
LENGTHS, ADVANTAGES = (4, 4, 40, 200), (1.0, 1.0, -1.0, -1.0)


def _first_step_loss(loss_agg, denominator=None, trajectories=range(4)):
    """The fused loss of the chosen trajectories at ratio 1 (old log-probs = current ones)."""
    g = torch.Generator().manual_seed(0)
    sid = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    adv = torch.cat([torch.full((n,), a) for n, a in zip(LENGTHS, ADVANTAGES)])
    hidden, weight = torch.randn(len(sid), 8, generator=g), torch.randn(16, 8, generator=g)
    targets = torch.randint(0, 16, (len(sid),), generator=g)
    keep = torch.isin(sid, torch.tensor(list(trajectories)))
    mask = torch.ones(int(keep.sum()), dtype=torch.bool)
    args = (hidden[keep], weight, targets[keep])
    lp = linear_policy_loss(*args, torch.zeros(len(mask)), adv[keep], mask, loss_agg=loss_agg, seq_ids=sid[keep],
                            denominator=denominator).logprob
    return float(linear_policy_loss(*args, lp, adv[keep], mask, loss_agg=loss_agg, seq_ids=sid[keep],
                                    denominator=denominator).loss)


def test_hand_example_token_mean_versus_the_papers_aggregation():
    assert _first_step_loss("token-mean") == pytest.approx(232 / 248, abs=1e-6)  # 0.935
    assert _first_step_loss("seq-mean-token-mean") == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("preset", ["paper", "starpo", "grpo", "paper,grpo"])
def test_presets_that_claim_the_papers_settings_use_its_loss_aggregation(preset, tmp_path):
    cfg = load_config(env="sokoban", preset=preset, overrides=[f"trainer.output_dir={tmp_path}",
                                                               "optim.mini_batch_size=4"])
    assert cfg.algorithm.loss_agg is None and cfg.loss_agg == "seq-mean-token-mean"
    # the trainer's mini-batch denominators: one mini-batch of the four trajectories, each
    # trajectory in its own micro-batch (as a small token budget packs them); the micro-batch
    # losses add up to the paper's value on the whole mini-batch
    masks = [torch.cat([torch.zeros(1, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]) for n in LENGTHS]
    (mb, n_tok, denom), = epoch_mini_batches(cfg, SINGLE, masks, torch.Generator().manual_seed(0))
    assert sorted(mb) == [0, 1, 2, 3] and n_tok == 248 and denom == 4.0
    total = sum(_first_step_loss(cfg.loss_agg, denom, [i]) for i in range(4))
    assert total == pytest.approx(0.0, abs=1e-6)
    assert sum(_first_step_loss("token-mean", 248.0, [i]) for i in range(4)) == pytest.approx(232 / 248, abs=1e-6)


@pytest.mark.parametrize("preset,extra", [("cpu", []), ("cpu,starpo", []), ("paper", ["algorithm.adv_estimator=drgrpo"]),
                                          ("paper", ["algorithm.loss_agg=seq-mean-token-sum-norm"])])
def test_drgrpo_drops_the_per_trajectory_length_average_for_a_constant(preset, extra, tmp_path):
    """Dr.GRPO (arXiv 2503.20783) removes the 1/|o_i| of GRPO's objective: sum_i sum_t l_it / (G C)
    with a constant C (here rollout.max_new_tokens x rollout.max_turns). The hand example:
    (-4 - 4 + 40 + 200) / (4 C). (Every preset called Dr.GRPO used to keep the paper's
    per-trajectory token mean: only the advantage followed Dr.GRPO.)"""
    cfg = load_config(env="sokoban", preset=preset, overrides=[f"trainer.output_dir={tmp_path}",
                                                               "optim.mini_batch_size=4", *extra])
    C = cfg.rollout.max_new_tokens * cfg.rollout.max_turns
    assert cfg.loss_agg == "seq-mean-token-sum-norm" and cfg.loss_norm == C
    masks = [torch.cat([torch.zeros(1, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]) for n in LENGTHS]
    (mb, _, denom), = epoch_mini_batches(cfg, SINGLE, masks, torch.Generator().manual_seed(0))
    assert denom == 4.0 * C
    # the trainer hands the kernels their "seq-mean-token-sum" with that denominator
    from fastpo.trainer.update import policy_loss_settings

    mode = policy_loss_settings(cfg).loss_agg
    total = sum(_first_step_loss(mode, denom, [i]) for i in range(4))
    assert total == pytest.approx(232 / (4 * C), abs=1e-6)
    fixed = load_config(env="sokoban", preset=preset, overrides=[f"trainer.output_dir={tmp_path}",
                                                                 "optim.mini_batch_size=4", *extra,
                                                                 "algorithm.loss_scale_factor=100"])
    assert next(epoch_mini_batches(fixed, SINGLE, masks, torch.Generator().manual_seed(0)))[2] == 400.0


def test_no_preset_sets_another_loss_aggregation():
    """The aggregation follows the estimator (TrainConfig.loss_agg), never a preset of its own."""
    assert not any("loss_agg" in p.get("algorithm", {}) for p in PRESETS.values())


# -- answer parsing and the format penalty ----------------------------------------------------
@pytest.fixture(scope="module")
def smol_tok():
    from fastpo.model_loading import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def _turn(rule, responses, run_valid=True):
    """One FrozenLake turn (3x3 map, no slip, start top-left) for each response text (the
    "<think>" prime included): (penalties, executed actions, player cells)."""
    from fastpo.config import RolloutConfig
    from fastpo.rollout.turns import env_turn

    env = make_native_env("frozenlake", len(responses), desc="SFF/FFF/FFG", is_slippery=False)
    env.reset(range(len(responses)))
    cfg = RolloutConfig(format_rule=rule, run_valid_actions_on_format_error=run_valid, format_penalty=-0.1)
    res = env_turn(env, cfg, ["<think>" + r for r in responses], np.full(len(responses), 10, dtype=np.int64))
    return res.penalty.tolist(), res.executed.tolist(), env._pos.tolist()


# response (after the prime) -> by hand: (penalised, actions run) under "ragen", then "strict"
FORMAT_CASES = [
    ("go</think><answer>Right</answer>", (False, 1), (False, 1)),
    ("go</think> <answer> right || DOWN </answer>", (False, 2), (False, 2)),
    ("go</think><answer>Right</answer> and more text", (False, 1), (True, 1)),  # text after the pattern
    ("go</think><answer>Right</answer><think>b</think><answer>Down</answer>", (False, 1), (True, 1)),  # 2 answers
    ("go <answer>Right</answer>", (True, 0), (True, 1)),  # no </think>: RAGEN finds no pattern, runs nothing
    ("go</think><answer>Right || Jump</answer>", (True, 1), (True, 1)),  # an invalid action: valid ones run
    ("go</think><answer></answer>", (True, 0), (True, 0)),
    ("I will go right.", (True, 0), (True, 0)),
]


@pytest.mark.parametrize("rule", ["ragen", "strict"])
def test_format_rules_penalties_and_actions_by_hand(rule):
    pen, ran, pos = _turn(rule, [c[0] for c in FORMAT_CASES])
    expected = [c[1] if rule == "ragen" else c[2] for c in FORMAT_CASES]
    assert [(p != 0, n) for p, n in zip(pen, ran)] == expected
    assert all(p in (0.0, pytest.approx(-0.1)) for p in pen)
    assert pos[0] == 1 and pos[1] == 4  # Right; Right then Down on the 3x3 map


def test_ragen_rule_is_the_default_and_run_valid_off_runs_nothing_when_penalised():
    from fastpo.config import RolloutConfig

    assert RolloutConfig().format_rule == "ragen"
    assert load_config(env="frozenlake", preset="paper").rollout.format_rule == "ragen"
    pen, ran, _ = _turn("ragen", ["go</think><answer>Right || Jump</answer>"], run_valid=False)
    assert pen == [pytest.approx(-0.1)] and ran == [0]
    with pytest.raises(ValueError, match="format_rule"):
        RolloutConfig(format_rule="loose")


class _StopStringEngine:
    """Returns fixed token ids for each turn, ending on a stop string as a real engine would."""

    def __init__(self, ids):
        self.ids = ids
        self.device = torch.device("cpu")
        self.reset_stats()

    def reset_stats(self):
        self.stats = {"prefilled_tokens": 0, "generated_tokens": 0, "seconds": 0.0}

    def start(self, prompts, group_size):
        pass

    def generate(self, sessions, append, params, generator=None):
        from fastpo.rollout import TurnOutput

        assert params.stop_strings == ("</answer>",)
        return [TurnOutput(list(self.ids), [-0.5] * len(self.ids), "stop_string") for _ in sessions]

    def finish(self):
        pass


@pytest.mark.parametrize("rule", ["ragen", "strict"])
@pytest.mark.parametrize("extra", [">.", ">,", "><", "></"])
def test_stop_string_completed_by_a_token_with_more_characters(smol_tok, rule, extra):
    # SmolLM2 has single tokens ">.", ">,", "><" and "></": an answer "<answer> Right </answer"
    # followed by one of them ends the turn at the stop string with extra characters after it;
    # the answer is well formed (vLLM and SGLang cut the text there) under either rule
    from fastpo.config import RolloutConfig
    from fastpo.rollout import MultiTurnRollout

    extra_id = smol_tok.convert_tokens_to_ids(extra)
    assert smol_tok.decode([extra_id]) == extra  # one token
    ids = smol_tok("go</think> <answer> Right </answer", add_special_tokens=False)["input_ids"] + [extra_id]
    cfg = RolloutConfig(max_turns=1, format_rule=rule)
    batch = MultiTurnRollout(_StopStringEngine(ids), smol_tok, "frozenlake",
                             {"desc": "SFF/FFF/FFG", "is_slippery": False}, cfg).generate([0], group_size=1)
    assert batch.format_penalty[0].tolist() == [0.0] and int(batch.num_actions[0]) == 1
    assert batch.response_texts[0][0] == "<think>go</think> <answer> Right </answer>"
    assert batch.responses[0][0].tolist() == ids  # the sampled ids, the extra token included
    model_ids = batch.input_ids[0][batch.loss_mask[0]].tolist()
    assert model_ids == ids


# -- KL as the paper applied it, and StarPO-S rounding ----------------------------------------
def test_kl_penalty_on_the_reward_hand_values():
    from fastpo.algorithms import apply_kl_penalty

    mask = torch.tensor([[False, True, True, False, True]])
    lp = torch.tensor([[0.0, -1.0, -2.0, 0.0, -0.5]])
    ref = torch.tensor([[9.0, -1.5, -1.0, 9.0, -0.5]])  # off-mask values must not count
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    out, kl = apply_kl_penalty(r, lp, ref, mask, 0.1, "k1")
    assert kl.tolist() == [[0.0, 0.5, -1.0, 0.0, 0.0]]  # k1 = lp - ref
    assert out[0].tolist() == pytest.approx([0.0, -0.05, 0.1, 0.0, 1.0])
    _, kl3 = apply_kl_penalty(r, lp, ref, mask, 0.1, "k3")  # exp(d) - d - 1, d = ref - lp
    d = [-0.5, 1.0, 0.0]
    assert kl3[0, [1, 2, 4]].tolist() == pytest.approx([np.exp(x) - x - 1 for x in d])
    with pytest.raises(ValueError, match="estimator"):
        apply_kl_penalty(r, lp, ref, mask, 0.1, "k2")


def _batch(scores, group_ids):
    from types import SimpleNamespace

    return SimpleNamespace(scores=torch.tensor(scores), group_ids=torch.tensor(group_ids), turn_index=None,
                           turn_rewards=None)


def _advantages(cfg):
    """The trainer's advantage step for `cfg`, one process (no model needed)."""
    from fastpo.trainer.batch_advantages import Advantages
    from fastpo.trainer.plan import rl_plan

    return Advantages(cfg, SINGLE, rl_plan(cfg, False))


def test_trainer_puts_the_kl_on_the_reward_before_gae(tmp_path):
    # one trajectory, model tokens 1, 2, 4; score 1 on token 4; values 0; gamma = lambda = 1;
    # k1 = 0.5, -1.0, 0.0; rewards -0.05, +0.1, 1.0; advantages = reward-to-go: 1.05, 1.1, 1.0
    cfg = load_config(env="frozenlake", preset="paper,starpo", overrides=[
        f"trainer.output_dir={tmp_path}", "algorithm.kl_coef=0.1", "algorithm.whiten_advantages=false",
        "optim.mini_batch_size=1"])
    assert cfg.kl_in_reward
    masks = [torch.tensor([False, True, True, False, True])]
    old = [torch.tensor([0.0, -1.0, -2.0, 0.0, -0.5])]
    ref = [torch.tensor([0.0, -1.5, -1.0, 0.0, -0.5])]
    adv, ret, m = _advantages(cfg).compute(_batch([1.0], [0]), masks, [torch.zeros(5)], old, ref)
    assert adv[0].tolist() == pytest.approx([0.0, 1.05, 1.1, 0.0, 1.0])
    assert m["train/kl_reward"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    # the loss-term option leaves the reward alone
    cfg_loss = load_config(env="frozenlake", preset="paper,starpo", overrides=[
        f"trainer.output_dir={tmp_path}", "algorithm.kl_coef=0.1", "algorithm.whiten_advantages=false",
        "algorithm.kl_in_reward=false", "optim.mini_batch_size=1"])
    adv2, _, m2 = _advantages(cfg_loss).compute(_batch([1.0], [0]), masks, [torch.zeros(5)], old, ref)
    assert adv2[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, 1.0]) and "train/kl_reward" not in m2


def test_kl_in_reward_with_a_group_estimator_lowers_the_score(tmp_path):
    # Dr.GRPO, scores 1 and 0, summed k1 2.0 and 0.0, coef 0.1: scores 0.8 and 0.0, mean 0.4
    cfg = load_config(env="frozenlake", preset="paper", overrides=[
        f"trainer.output_dir={tmp_path}", "algorithm.adv_estimator=drgrpo", "algorithm.kl_coef=0.1",
        "algorithm.kl_in_reward=true", "rollout.group_size=2", "optim.mini_batch_size=2"])
    masks = [torch.tensor([False, True, True]), torch.tensor([False, True, True])]
    old = [torch.tensor([0.0, -1.0, -1.0]), torch.tensor([0.0, -1.0, -1.0])]
    ref = [torch.tensor([0.0, -2.0, -2.0]), torch.tensor([0.0, -1.0, -1.0])]
    adv, _, _ = _advantages(cfg).compute(_batch([1.0, 0.0], [0, 0]), masks, None, old, ref)
    assert adv[0].tolist() == pytest.approx([0.0, 0.4, 0.4]) and adv[1].tolist() == pytest.approx([0.0, -0.4, -0.4])


# the CPU preset trains with Dr.GRPO, a group estimator: its KL goes into the loss
@pytest.mark.parametrize("preset,in_reward", [("starpo", True), ("paper,starpo", True), ("cpu,starpo", False),
                                              ("starpo,grpo", False)])
def test_starpo_preset_is_the_papers_vanilla_starpo(preset, in_reward, tmp_path):
    cfg = load_config(env="sokoban", preset=preset, overrides=[f"trainer.output_dir={tmp_path}",
                                                               "optim.mini_batch_size=4"])
    a = cfg.algorithm
    assert (a.kl_coef, a.kl_estimator, a.clip_low, a.clip_high, a.filter_mode) == (0.001, "k1", 0.2, 0.2, "none")
    assert cfg.kl_in_reward is in_reward


@pytest.mark.parametrize("groups,ratio,kept", [(8, 0.35, 2), (8, 0.25, 2), (8, 0.5, 4), (8, 0.1, 1), (10, 0.29, 2),
                                               (16, 0.25, 4), (3, 0.5, 1), (8, 1.0, 8)])
def test_starpo_s_keeps_the_floor_of_ratio_times_groups(groups, ratio, kept):
    # RAGEN at 540ab84: topk(int(ratio * num_groups)); fastpo keeps at least one group
    from fastpo.algorithms import filter_groups

    g = torch.arange(groups).repeat_interleave(2)
    scores = torch.stack([torch.zeros(groups), torch.arange(groups, dtype=torch.float32)], 1).flatten()  # std grows with g
    res = filter_groups(scores, g, ratio, "top")
    assert res.kept_groups == list(range(groups - kept, groups))


def test_top_filter_with_one_trajectory_per_group_warns_and_keeps_all(tmp_path):
    from fastpo.algorithms import filter_groups

    with pytest.warns(RuntimeWarning, match="undefined"):
        res = filter_groups(torch.tensor([0.0, 1.0, 0.5, 0.2]), torch.arange(4), 0.25, "top")
    assert res.kept_groups == [0, 1, 2, 3] and res.kept_ratio == 1.0
    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "algorithm.filter_mode=top",
        "rollout.group_size=1", "rollout.env_groups=4", "optim.mini_batch_size=4", "algorithm.adv_estimator=gae"])
    assert cfg.kept_groups == 4
    console = Console(record=True, width=200)
    Trainer(cfg, console=console).setup()
    assert "in-group reward std is undefined" in console.export_text()
