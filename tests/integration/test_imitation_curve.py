"""experiments/imitation_curve.py: the cheap imitation learning curve (issue 33) runs (on the random
tiny model, which has the embedded model's tokenizer, so the expert's turns are the same), scores
every expert turn it builds, and refuses bad sizes in one line."""
import pathlib
import json
import os
import subprocess
import sys

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
TOOL = os.path.join(ROOT, "experiments", "imitation_curve.py")


def test_one_step_curve(tmp_path):
    out = tmp_path / "curve.json"
    r = subprocess.run([sys.executable, TOOL, "--levels", "4", "--held-out", "2", "--steps", "1", "--batch", "2",
                        "--every", "1", "--lr", "1e-4", "--model", "random:tiny-llama", "--json", str(out)],
                       capture_output=True, text=True, encoding="utf-8", timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text(encoding="utf-8"))
    from fastpo.config.loading import load_config
    from fastpo.config.schema import eval_seeds
    from fastpo.model_loading import load_tokenizer
    from fastpo.sft import expert_rollout

    cfg = load_config(env="sokoban", preset="cpu", overrides=["rollout.max_turns=10", "rollout.max_actions_per_traj=10",
                                                              "rollout.max_actions_per_turn=1"])
    tok = load_tokenizer(cfg.model.name)
    rc = cfg.rollout.rollout_config()
    # one example per expert answer: the regex over the rendered text misses none
    turns = [int(expert_rollout(tok, "sokoban", cfg.env.options, rc, seeds, 1).num_turns.sum())
             for seeds in (list(range(4)), eval_seeds(cfg)[:2])]
    assert (res["training_turns"], res["held_out_turns"]) == tuple(turns)
    assert [row["step"] for row in res["rows"]] == [0, 1]
    for row in res["rows"]:
        assert 0 <= row["held_out_accuracy"] <= 1 and 0 <= row["train_accuracy"] <= 1
        assert row["held_out_nll"] > 0 and row["train_nll"] > 0
    # the training moved the model: the probe's NLL changed after one AdamW step at 1e-4
    assert res["rows"][1]["train_nll"] != res["rows"][0]["train_nll"]


def test_bad_size_is_one_line():
    r = subprocess.run([sys.executable, TOOL, "--steps", "0"], capture_output=True, text=True, encoding="utf-8",
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip() == "imitation_curve: --steps 0: must be >= 1"
