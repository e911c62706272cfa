"""Config: paper defaults, presets, YAML + dotted overrides, validation errors naming the key."""
import pytest

from fastpo.config import TrainConfig, config_from_dict, load_config
from fastpo.config.fields import ConfigError, parse_override
from fastpo.config.files import dump_yaml


def test_paper_defaults():
    c = load_config(env="sokoban", preset="paper")
    r, a, o, t = c.rollout, c.algorithm, c.optim, c.trainer
    assert (r.env_groups, r.group_size, r.max_turns, r.max_actions_per_traj) == (8, 16, 5, 10)
    assert (a.gamma, a.lam, a.entropy_coef, a.clip_low, a.clip_high) == (1.0, 1.0, 0.001, 0.2, 0.28)
    assert (a.filter_mode, a.filter_ratio, a.kl_coef) == ("top", 0.25, 0.0)
    assert (o.actor_lr, o.critic_lr, o.grad_clip, o.mini_batch_size) == (1e-6, 1e-5, 1.0, 32)
    assert (t.iterations, t.eval_seeds, t.eval_temperature, t.eval_every) == (200, 256, 0.5, 10)
    assert c.train_batch_size == 32  # 2 of 8 groups kept x 16


def test_env_and_named_presets_layer():
    c = load_config(env="bandit", preset="cpu,grpo")
    assert c.rollout.max_turns == 1 and c.rollout.env_groups == 4
    assert c.algorithm.adv_estimator == "grpo"
    f = load_config(env="frozenlake", preset="cpu")
    assert f.rollout.max_turns == 5 and f.rollout.max_new_tokens == 16  # the env preset keeps the CPU scale
    assert f.rollout.prompt_examples and not f.rollout.think and f.algorithm.adv_estimator == "drgrpo"
    assert f.trainer.eval_before_training and f.trainer.eval_seeds == 64 and f.trainer.eval_temperature == 0.5
    s = load_config(env="frozenlake", preset="paper,starpo")
    assert s.algorithm.kl_coef > 0 and s.algorithm.clip_high == s.algorithm.clip_low
    assert s.algorithm.filter_mode == "none"


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("preset: cpu\nenv: {name: bandit}\nalgorithm:\n  adv_estimator: drgrpo\n  clip_high: 0.3\n")
    c = load_config(file=str(p), overrides=["algorithm.clip_high=0.35", "trainer.iterations=7",
                                            "algorithm.dual_clip=null"])
    assert c.env.name == "bandit" and c.preset == "cpu"
    assert c.algorithm.adv_estimator == "drgrpo" and c.algorithm.clip_high == 0.35
    assert c.trainer.iterations == 7 and c.algorithm.dual_clip is None
    # int given for a float field is accepted
    assert load_config(env="bandit", preset="cpu", overrides=["optim.actor_lr=1"]).optim.actor_lr == 1.0
    # round trip through a dict (resume path)
    assert config_from_dict(c.to_dict()) == c
    assert "adv_estimator: drgrpo" in dump_yaml(c)


@pytest.mark.parametrize("override, words", [
    ("algorithm.adv_estimatr=grpo", ["algorithm.adv_estimatr", "unknown"]),
    ("nosection.x=1", ["nosection", "unknown"]),
    ("rollout.group_size=0", ["rollout.group_size", ">= 1"]),
    ("rollout.group_size=two", ["rollout.group_size", "expected int"]),
    ("rollout.group_size=2.5", ["rollout.group_size", "expected int"]),
    ("algorithm.clip_high=0.1", ["algorithm.clip_high", "clip_low"]),
    ("optim.mini_batch_size=64", ["optim.mini_batch_size", "larger than the training batch"]),
    ("algorithm.adv_estimator=ppo", ["algorithm.adv_estimator", "one of"]),
    ("trainer.eval_temperature=0", ["trainer.eval_temperature", "> 0"]),
    ("algorithm.filter_ratio=1.5", ["algorithm.filter_ratio"]),
    ("algorithm.whiten_advantages=1", ["algorithm.whiten_advantages", "expected bool"]),
    ("rollout=3", ["rollout", "mapping"]),
    ("noequals", ["section.key=value"]),
])
def test_validation_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(env="frozenlake", preset="paper", overrides=[override])
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("override", ["preset=paper", "preset=nonsense"])
def test_preset_as_dotted_override_is_refused(override):
    # it used to set only the label: `preset=paper` on the CPU ran the cpu preset's settings
    # while config.yaml and the header said "paper"
    with pytest.raises(ConfigError, match="--preset"):
        load_config(env="bandit", preset="cpu", overrides=[override])


def test_grpo_needs_groups_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="group_size"):
        load_config(env="bandit", preset="cpu", overrides=["algorithm.adv_estimator=grpo", "rollout.group_size=1",
                                                           "optim.mini_batch_size=1"])
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(env="bandit", preset="fast")
    with pytest.raises(ConfigError, match="unknown env"):
        load_config(env="chess", preset="cpu")
    p = tmp_path / "bad.yaml"
    p.write_text("algorithm: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(file=str(p))


def test_parse_override_types():
    assert parse_override("a.b=0.5") == {"a": {"b": 0.5}}
    assert parse_override("optim.actor_lr=2e-4") == {"optim": {"actor_lr": 2e-4}}
    assert parse_override("a.b=true") == {"a": {"b": True}}
    assert parse_override("a.b=[1, 2]") == {"a": {"b": [1, 2]}}
    assert isinstance(TrainConfig().to_dict(), dict)


def test_unknown_key_suggests_the_dotted_or_near_key():
    import pytest

    from fastpo.config import load_config
    from fastpo.config.fields import ConfigError

    for override, hint in (("group_size=8", "did you mean rollout.group_size?"),
                           ("rollout.grup_size=8", "did you mean rollout.group_size?"),
                           ("algorithm.clip_hi=0.3", "did you mean algorithm.clip_high?")):
        with pytest.raises(ConfigError, match=hint.replace("?", r"\?")):
            load_config(env="bandit", overrides=[override])
    with pytest.raises(ConfigError) as e:
        load_config(env="bandit", overrides=["foo=1"])
    assert "did you mean" not in str(e.value)


def test_unknown_key_of_any_yaml_type_is_a_config_error():
    import pytest

    from fastpo.config import TrainConfig
    from fastpo.config.fields import ConfigError, apply_dict

    for updates in ({"rollout": {1: 2}}, {"rollout": {None: 3}}, {"trainer": {True: 1}}):
        with pytest.raises(ConfigError, match="unknown config key"):
            apply_dict(TrainConfig(), updates)
    with pytest.raises(ConfigError, match="did you mean model.name or env.name"):
        apply_dict(TrainConfig(), {"name": "x"})


@pytest.mark.parametrize("key,bad", [("temperature", 0), ("format_penalty", 0.5), ("max_actions_per_turn", 65),
                                     ("top_p", 0), ("top_k", -1), ("max_turns", 0)])
def test_rollout_fields_have_one_rule_and_one_message(key, bad):
    """RolloutConfig (used on its own by library users) and the training config's rollout
    section refuse the same values with the same words: one rule per field. (RolloutConfig
    accepted temperature 0, a positive format penalty and 65 actions per turn before.)"""
    from fastpo.config import RolloutConfig

    with pytest.raises(ConfigError) as train_err:
        load_config(env="frozenlake", overrides=[f"rollout.{key}={bad}"])
    with pytest.raises(ValueError) as lib_err:
        RolloutConfig(**{key: bad})
    why = str(train_err.value).split(": ", 1)[1]
    assert str(train_err.value).startswith(f"config key 'rollout.{key}' = ")
    assert str(lib_err.value) == f"config key 'RolloutConfig.{key}' = {bad!r}: {why}"


def test_greedy_decoding_is_the_engines_not_a_rollout_setting():
    from fastpo.config import RolloutConfig
    from fastpo.rollout.sampling import SamplingParams

    assert SamplingParams(temperature=0).temperature == 0  # the engine's greedy decoding stays
    with pytest.raises(ValueError, match="SamplingParams.temperature' = -1: must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="RolloutConfig.temperature' = 0: must be > 0"):
        RolloutConfig(temperature=0)


@pytest.mark.parametrize("key,bad", [("algorithm.gamma", 1.5), ("optim.micro_token_budget", 8), ("trainer.seed", -1),
                                     ("trainer.device", "tpu"), ("model.lora_dropout", 1.0),
                                     ("algorithm.is_cap", 1.0), ("rollout.replay", -1)])
def test_single_field_rules_live_on_the_fields(key, bad):
    """validate() reads each field's own rule (config.checked metadata): the error from a full
    load equals the one check_fields gives for the section alone."""
    from fastpo.config import TrainConfig
    from fastpo.config.fields import check_fields

    with pytest.raises(ConfigError) as full:
        load_config(env="frozenlake", overrides=[f"{key}={bad}"])
    section, name = key.split(".")
    part = getattr(TrainConfig(), section)
    setattr(part, name, float(bad) if isinstance(getattr(part, name), float) else bad)  # as apply_dict coerces
    with pytest.raises(ConfigError) as alone:
        check_fields(part, f"{section}.")
    assert str(full.value) == str(alone.value) and key in str(full.value)


def test_override_with_invalid_yaml_is_one_line():
    # `env.options={p:` (the shell split `{p: 2}`) used to print PyYAML's 4-line message
    with pytest.raises(ConfigError) as e:
        load_config(env="frozenlake", preset="cpu", overrides=["env.options={p:"])
    assert "env.options={p:" in str(e.value) and "not valid YAML" in str(e.value) and "\n" not in str(e.value)


def test_policy_loss_keys_are_checked_in_one_line():
    ok = load_config(env="bandit", preset="tiny", overrides=["algorithm.policy_loss=sapo"])
    assert ok.algorithm.policy_loss == "sapo" and ok.algorithm.sapo_tau_neg == 1.05
    bad = [
        ("algorithm.policy_loss=dpo", "algorithm.policy_loss"),
        ("algorithm.sapo_tau_pos=0", "algorithm.sapo_tau_pos"),
        ("algorithm.cov_ratio=0", "algorithm.cov_ratio"),
        ("algorithm.cov_ratio=2", "algorithm.cov_ratio"),
        ("algorithm.kl_cov_coef=-1", "algorithm.kl_cov_coef"),
    ]
    for override, key in bad:
        with pytest.raises(ConfigError, match=key) as e:
            load_config(env="bandit", preset="tiny", overrides=[override])
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="algorithm.ratio_level.*not 'kl_cov'"):
        load_config(env="bandit", preset="tiny", overrides=["algorithm.policy_loss=kl_cov", "algorithm.ratio_level=sequence"])
    with pytest.raises(ConfigError, match=r"'algorithm.clip_cov_lb' = 5.0: must be below clip_cov_ub \(1.0\)"):
        load_config(env="bandit", preset="tiny", overrides=["algorithm.clip_cov_lb=5", "algorithm.clip_cov_ub=1"])
    load_config(env="bandit", preset="tiny", overrides=["algorithm.policy_loss=cispo", "algorithm.ratio_level=sequence"])


def test_the_trainer_passes_the_dual_clip_only_to_a_loss_that_has_one():
    from fastpo.trainer.update import policy_loss_settings

    for loss, dual in (("ppo", 3.0), ("clip_cov", 3.0), ("cispo", None), ("sapo", None), ("kl_cov", None)):
        cfg = load_config(env="bandit", preset="tiny", overrides=[f"algorithm.policy_loss={loss}",
                                                                  "algorithm.dual_clip=3.0"])
        s = policy_loss_settings(cfg)
        assert (s.loss, s.dual_clip) == (loss, dual)


@pytest.mark.parametrize("override,words", [
    ("reward.judge_fallback=1e39", "must be a finite number within float32's range"),
    ("rollout.format_penalty=-1e39", "must be a finite number within float32's range"),
    ("algorithm.sapo_tau_pos=1e-45", "SAPO's gate scale 4 / tau must be finite in float32"),
    ("algorithm.sapo_tau_neg=1e-40", "SAPO's gate scale 4 / tau must be finite in float32"),
])
def test_values_that_overflow_float32_are_refused_before_any_model_loads(override, words, no_model, capsys):
    """Issue 58 item 2: finite Python floats that are inf in float32 (or make SAPO's gate inf)
    passed every check; the run then skipped every update and exited 0."""
    from fastpo.cli import main

    key = override.split("=")[0]
    assert main(["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{key}'" in err[0] and words in err[0], err


def test_dynamic_max_draws_has_no_upper_bound_as_documented():
    """Issue 58 item 16 (a note, decided): a huge cap is accepted, as verl's max_num_gen_batches
    has none; docs/algorithms.md says what it costs. An int is needed (1e9 is YAML text, read as
    a float, refused naming the type)."""
    from pathlib import Path

    cfg = load_config(env="bandit", preset="tiny", overrides=["algorithm.filter_mode=dynamic",
                                                               "algorithm.dynamic_max_draws=1000000000"])
    assert cfg.algorithm.dynamic_max_draws == 10**9
    with pytest.raises(ConfigError, match="dynamic_max_draws': expected int"):
        load_config(env="bandit", preset="tiny", overrides=["algorithm.dynamic_max_draws=1e9"])
    doc = " ".join((Path(__file__).resolve().parents[3] / "docs" / "algorithms.md").read_text().split())
    assert "The cap has no upper bound (as verl's `max_num_gen_batches`" in doc
