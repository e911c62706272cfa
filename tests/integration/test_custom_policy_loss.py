"""A policy loss of one's own (issue 57 item 3): one function registered with its facts through
the public API (`fastpo.kernels.register_policy_loss`), here from a test file as from a user's
module, is a value of `algorithm.policy_loss`; its own setting is a config key checked by its
rule (one line naming the value, exit 2 from the CLI before any model loads); it runs fused with
the LM head and trains one iteration like the built-in losses."""
import math

import pytest
import torch
from rich.console import Console

from fastpo.config import ConfigError, load_config
from fastpo.kernels import (POLICY_LOSSES, LossSetting, PolicyGradient, PolicyLossSettings, linear_policy_loss,
                            reference_logprob_entropy, register_policy_loss)
from fastpo.kernels import losses as registry

from kernel_data import lm_head_data

TOY_SCALE = LossSetting("toy_scale", 1.0, lambda v: v > 0, "must be > 0", "the toy loss's scale of -A r.")
calls = []


def toy(x, s):
    """The unclipped surrogate scaled: pg = -toy_scale A r; logs the share of tokens with A > 0."""
    calls.append(s.toy_scale)
    return PolicyGradient(-s.toy_scale * x.advantages * x.ratio, fractions={"toy_positive": x.advantages > 0})


@pytest.fixture
def restore_registry():
    """The registry as it was once the test is done (a loss registered here is gone after it, so
    that other tests' configs and the generated config reference do not see it)."""
    saved = dict(registry.POLICY_LOSSES)
    yield
    registry._LOSSES.clear()
    registry._LOSSES.update(saved)


@pytest.fixture
def toy_loss(restore_registry):
    calls.clear()
    register_policy_loss("toy", settings=(TOY_SCALE,), paper="this test's own")(toy)
    return POLICY_LOSSES["toy"]


def test_a_registered_loss_trains_one_tiny_iteration(toy_loss, tmp_path):
    from fastpo.trainer import Trainer
    from fastpo.trainer.update import policy_loss_settings

    out = tmp_path / "run"
    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={out}", "model.name=random:tiny-llama", "algorithm.adv_estimator=grpo",
        "algorithm.policy_loss=toy", "algorithm.toy_scale=0.5", "trainer.iterations=1", "trainer.eval_every=0",
        "trainer.plots=false"])
    assert cfg.algorithm.toy_scale == 0.5 and cfg.algorithm.loss_settings["toy_scale"] == 0.5
    s = policy_loss_settings(cfg)
    # its facts: no dual clip, so algorithm.dual_clip (3.0 by default) is left unused
    assert (s.loss, s.toy_scale, s.dual_clip, cfg.algorithm.dual_clip) == ("toy", 0.5, None, 3.0)
    rec = Trainer(cfg, console=Console(quiet=True)).run()[0]
    assert calls and set(calls) == {0.5}  # the trainer's fused loss ran this function, with its setting
    assert math.isfinite(rec["actor/pg_loss"]) and rec["actor/grad_norm"] > 0
    assert 0 <= rec["actor/toy_positive"] <= 1  # its own event's share, logged as the built-ins' are
    assert rec["actor/clipfrac"] == 0.0  # it clips nothing
    assert "  toy_scale: 0.5\n" in (out / "config.yaml").read_text()  # the run's settings keep it


def test_a_bad_setting_of_a_registered_loss_is_refused_in_one_line(toy_loss, no_model, capsys):
    from fastpo.cli import main

    with pytest.raises(ConfigError) as e:
        load_config(env="bandit", preset="tiny", overrides=["algorithm.policy_loss=toy", "algorithm.toy_scale=-2"])
    assert str(e.value) == "config key 'algorithm.toy_scale' = -2.0: must be > 0"
    with pytest.raises(ConfigError, match="'algorithm.toy_scale': expected float, got 'big'"):
        load_config(env="bandit", preset="tiny", overrides=["algorithm.toy_scale=big"])
    with pytest.raises(ConfigError, match="'algorithm.ratio_level' = 'sequence': .* not 'toy'"):
        load_config(env="bandit", preset="tiny",
                    overrides=["algorithm.policy_loss=toy", "algorithm.ratio_level=sequence"])
    assert main(["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama",
                 "algorithm.policy_loss=toy", "algorithm.toy_scale=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'algorithm.toy_scale' = 0.0: must be > 0" in err[0], err
    # the library's settings check the same rule
    with pytest.raises(ValueError, match=r"^toy_scale must be > 0, got -1$"):
        PolicyLossSettings(loss="toy", toy_scale=-1)
    with pytest.raises(ValueError, match="toy_scale must be a finite number, got nan"):
        PolicyLossSettings(loss="toy", toy_scale=math.nan)
    with pytest.raises(ValueError, match="dual_clip=3.0 applies to PPO's clipped surrogate .*not loss='toy'"):
        PolicyLossSettings(loss="toy", dual_clip=3.0)


def test_a_registered_loss_runs_fused_with_the_lm_head(toy_loss):
    """The chunked path against the reference, and both against the loss written out by hand on
    materialized logits: the fused paths take a new loss with no change of their own."""
    hidden, weight, targets = lm_head_data(40, 8, 50, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets)
    old, adv = lp + 0.2 * torch.randn(40, generator=g), torch.randn(40, generator=g)
    mask = torch.rand(40, generator=g) > 0.3
    settings = PolicyLossSettings(loss="toy", toy_scale=2.0)
    grads, losses = {}, {}
    for impl in ("reference", "chunked"):
        h = hidden.clone().requires_grad_(True)
        out = linear_policy_loss(h, weight, targets, old, adv, mask, settings=settings, impl=impl, chunk_size=16)
        out.loss.backward()
        grads[impl], losses[impl] = h.grad, out.loss.detach()
        assert out.metrics["toy_positive"] == pytest.approx(float((adv[mask] > 0).float().mean()))
    h = hidden.clone().requires_grad_(True)
    lp_h, _ = reference_logprob_entropy(h, weight, targets)
    by_hand = (-2.0 * adv * torch.exp(lp_h - old))[mask].mean()  # token-mean of -toy_scale A r
    by_hand.backward()
    torch.testing.assert_close(losses["chunked"], losses["reference"])
    torch.testing.assert_close(losses["reference"], by_hand.detach())
    torch.testing.assert_close(grads["chunked"], grads["reference"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads["reference"], h.grad, atol=1e-6, rtol=1e-5)


def test_registration_refuses_what_would_be_ambiguous(restore_registry):
    def pg(x, s):
        return PolicyGradient(-x.advantages * x.ratio)

    bad = [
        (("ppo",), {}, "policy loss 'ppo' is registered already"),
        (("not a name",), {}, "must be a Python identifier, got 'not a name'"),
        (("mine",), {"settings": (LossSetting("clip_low", 0.1),)}, "setting name 'clip_low' must be an identifier "
                                                                    "other than the shared settings"),
        (("mine",), {"settings": (LossSetting("cov_ratio", 0.1),)}, "setting 'cov_ratio' is another loss's already"),
        (("mine",), {"settings": (TOY_SCALE, TOY_SCALE)}, "declares setting 'toy_scale' twice"),
        (("mine",), {"settings": (LossSetting("mine_k", 0, lambda v: v > 0, "must be > 0", kind=int),)},
         "the default of mine_k must be > 0, got 0"),
        (("mine",), {"settings": (TOY_SCALE, {"name": "x"})}, "settings must be LossSetting objects"),
    ]
    for args, kw, match in bad:
        with pytest.raises(ValueError, match=match) as e:
            register_policy_loss(*args, **kw)(pg)
        assert "\n" not in str(e.value)
    assert "mine" not in POLICY_LOSSES
    # a setting named like an algorithm key would be read as that key: the config refuses it
    register_policy_loss("mine", settings=(LossSetting("gamma", 0.5),))(pg)
    with pytest.raises(ConfigError, match="takes a setting named 'gamma', which is the config key 'algorithm.gamma'"):
        load_config(env="bandit", preset="tiny")


def test_the_documented_example_is_the_real_api(restore_registry):
    """docs/algorithms.md's "Adding a policy loss": its registration runs as written, and the
    loss is then a config value whose setting is checked as the page says."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    section = page.split("## Adding a policy loss", 1)[1].split("\n## ", 1)[0]
    register, configure = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    exec(compile(register, "docs/algorithms.md", "exec"), {})
    overrides = re.search(r"overrides=(\[.*?\])", configure, flags=re.S).group(1)
    cfg = load_config(env="bandit", preset="tiny", overrides=eval(overrides))
    assert (cfg.algorithm.policy_loss, cfg.algorithm.pg_scale) == ("scaled_pg", 0.5)
    with pytest.raises(ConfigError) as e:
        load_config(env="bandit", preset="tiny", overrides=["algorithm.policy_loss=scaled_pg", "algorithm.pg_scale=0"])
    assert f"`{e.value}`" in " ".join(section.split())
