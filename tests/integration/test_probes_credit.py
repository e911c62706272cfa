"""StarPO's credit over turns on the probe games (fastpo.envs.probes, docs/probes.md): credit
reaches an earlier turn (probe:delayed) and the turn-level discount decides which answer is
best (probe:discount); each fails when the property is broken on purpose. The runs and their
judge as in tests/integration/test_probes_learning.py (in two files so that two test workers share them)."""
import pytest

from probe_helpers import ESTIMATORS, TARGET, eval_success, last_turn_only, starpo, turn_discount_ignored

pytestmark = pytest.mark.slow


# --- two turns, the reward at the end decided by the first answer: credit reaches turn 1 -----

@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_credit_reaches_the_first_turn(probe_model, tmp_path, estimator):
    records = starpo(probe_model, "delayed", tmp_path, estimator, 20, "algorithm.reward_position=turn")
    assert eval_success(records) >= TARGET


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_credit_for_the_last_turn_only_learns_nothing(probe_model, tmp_path, monkeypatch, estimator):
    last_turn_only(monkeypatch)
    assert eval_success(starpo(probe_model, "delayed", tmp_path, estimator, 20)) < 0.8


# --- A now or twice as much a turn later: the discount decides --------------------------------
# (The turn-level discount: token-level gamma applies between the answer and the reward of its
# own turn too, so that "A" keeps only gamma^3 of its reward and the closing tokens carry the
# signal; at gamma = 0.5 the tiny model still sat at 0.375 after 20 iterations: docs/probes.md.)

@pytest.mark.parametrize("estimator,extra,waits", [
    ("grpo", [], True),                                          # trajectory scores: 2 > 1
    ("gae", [], True),                                           # gamma = 1
    ("turn_rloo", [], True),                                     # undiscounted rewards-to-go
    ("bilevel_gae", [], True),                                   # 2 x 0.95 > 1 over the turn
    ("bilevel_gae", ["algorithm.high_level_gamma=0.4"], False),  # 2 x 0.4 < 1
])
def test_the_discount_decides_which_answer_is_best(probe_model, tmp_path, estimator, extra, waits):
    success = eval_success(starpo(probe_model, "discount", tmp_path, estimator, 20, "algorithm.reward_position=turn",
                                  *extra))
    assert success >= TARGET if waits else success <= 1 - TARGET


def test_a_turn_discount_that_never_reaches_the_advantages_keeps_waiting(probe_model, tmp_path, monkeypatch):
    turn_discount_ignored(monkeypatch)
    success = eval_success(starpo(probe_model, "discount", tmp_path, "bilevel_gae", 20,
                                  "algorithm.reward_position=turn", "algorithm.high_level_gamma=0.4"))
    assert success >= TARGET
