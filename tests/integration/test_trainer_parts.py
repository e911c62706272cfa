"""Trainer parts without a rollout: metrics JSONL + EMA, Echo-Trap warning, plots, samples, checkpoints."""
import dataclasses
import json
import os

import torch
import transformers

from fastpo.run.checkpoint import load_state, save_checkpoint, set_rng_state
from fastpo.run.manifest import latest_checkpoint
from fastpo.report.metrics import EchoTrapDetector, MetricsLogger, write_samples
from fastpo.report.plots import plot_curves
from fastpo.report.summary import summary_table


def test_metrics_jsonl_ema_and_resume_truncation(tmp_path):
    log = MetricsLogger(str(tmp_path), ema_decay=0.5)
    for it, x in enumerate([1.0, 3.0, 5.0], start=1):
        rec = log.log(it, {"train/success_rate": x, "bad": float("nan"), "flag": True})
    assert rec["ema/train/success_rate"] == 0.5 * (0.5 * 1 + 0.5 * 3) + 0.5 * 5  # 3.5
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in lines] == [1, 2, 3] and lines[0]["bad"] is None and lines[0]["flag"] == 1
    # resume from iteration 2: iteration 3 is dropped and the EMA rebuilt, so re-logging gives the same record
    log2 = MetricsLogger(str(tmp_path), ema_decay=0.5, resume_from=2)
    rec2 = log2.log(3, {"train/success_rate": 5.0, "bad": float("nan"), "flag": True})
    assert rec2 == rec
    assert [json.loads(line)["iteration"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    paths = plot_curves(log2.records, str(tmp_path / "plots"))
    assert paths and all(os.path.getsize(p) > 1000 for p in paths)
    assert summary_table(log2.records).row_count >= 1


def test_echo_trap_detector_fires_only_on_collapse():
    det = EchoTrapDetector(drop=0.5, window=2)
    k = (EchoTrapDetector.STD_KEY, EchoTrapDetector.ENT_KEY, EchoTrapDetector.SUCCESS_KEY)

    def rec(std, ent, succ):
        return {k[0]: std, k[1]: ent, k[2]: succ}

    assert det.update(rec(0.4, 2.0, 0.1)) is None and det.update(rec(0.4, 2.0, 0.1)) is None
    assert det.update(rec(0.3, 1.5, 0.1)) is None  # fell, but by less than half
    assert det.update(rec(0.1, 0.9, 0.3)) is None  # success rose: learning, not a trap
    assert det.update(rec(0.3, 0.5, 0.0)) is None  # only entropy collapsed
    msg = det.update(rec(0.1, 0.5, 0.05))
    assert msg and "Echo Trap" in msg


def test_samples_written(tmp_path):
    p = write_samples(str(tmp_path), 3, ["turn one\nturn two", "x"], header="eval")
    text = open(p).read()
    assert p.endswith("iter_000003.txt") and "trajectory 1" in text and "turn two" in text


def test_checkpoint_atomic_hf_loadable_and_rng(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(cfg)
    head = torch.nn.Linear(16, 1)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    for it in (1, 2, 3):
        path = save_checkpoint(str(tmp_path), it, model=model, tokenizer=None, optimizers={"actor": opt},
                               state={"note": it}, config_yaml="a: 1\n", value_head=head, keep=2)
    assert latest_checkpoint(str(tmp_path)) == path
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["iter_000002", "iter_000003", "latest"]  # no temp folders left, oldest pruned
    again = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"))
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    state, opts = load_state(path)
    assert state["iteration"] == 3 and state["note"] == 3 and "actor" in opts
    opt2 = torch.optim.AdamW(list(again.parameters()) + list(torch.nn.Linear(16, 1).parameters()), lr=1e-3)
    opt2.load_state_dict(opts["actor"])
    set_rng_state(state["rng"])
    a = torch.rand(3)
    set_rng_state(state["rng"])
    assert torch.equal(a, torch.rand(3))


def test_tensorboard_mirror(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=True)
    log.log(1, {"train/success_rate": 0.5})
    log.amend_last({"echo_trap_warning": 1})
    log.close()
    events = [f for _, _, fs in os.walk(tmp_path / "tensorboard") for f in fs if "tfevents" in f]
    assert events and json.loads(open(tmp_path / "metrics.jsonl").read())["echo_trap_warning"] == 1


def test_shared_prompt_packing_changes_nothing_but_cost(tmp_path):
    """The trainer's old log-probs, values and one PPO update are the same whether each env
    group's prompt is packed once (optim.share_prefix, the default) or once per trajectory."""
    import copy

    from rich.console import Console

    from fastpo.config import load_config
    from fastpo.trainer import Trainer

    cfg = load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "rollout.group_size=3",
        "rollout.env_groups=2", "rollout.max_new_tokens=12", "optim.mini_batch_size=6",
        "optim.micro_token_budget=4096", "trainer.plots=false"])
    tr = Trainer(cfg, console=Console(quiet=True))
    tr.setup()
    from fastpo.trainer.batch import TrainBatch

    batch = tr.parts.sampler.generate([3, 4], 3, 1.0, seed=0)
    record = TrainBatch.from_rollout(batch, 1)
    ids, masks = record.input_ids, record.loss_mask
    start = copy.deepcopy(tr.model.state_dict()), copy.deepcopy(tr.parts.models.value_head.state_dict())
    results = {}
    grads: list = []
    step = tr.parts.updater.optimizer_step

    def keep_grads(metrics):  # the gradients as the step sees them (the update frees them after it)
        grads[:] = [p.grad.clone() for p in tr.model.parameters()]
        return step(metrics)

    tr.parts.updater.optimizer_step = keep_grads
    for share in (True, False):
        tr.cfg.optim.share_prefix = share
        tr.model.load_state_dict(start[0])
        tr.parts.models.value_head.load_state_dict(start[1])
        tr.parts.updater.actor_opt.state.clear()
        computed = [pb.num_tokens for pb in tr.parts.logprobs.micro_batches(record, list(range(len(ids))))]
        old_lp, ent, vals, _ = tr.parts.logprobs.compute_old(record)
        adv, returns, _ = tr.advantages.compute(batch, masks, vals)
        tr.parts.updater.update(1, dataclasses.replace(record, old_logprobs=old_lp, values=vals, advantages=adv, returns=returns))
        # the last mini-batch's gradients (before clipping)
        results[share] = (sum(computed), old_lp, vals, list(grads))
        assert all(p.grad is None for p in tr.model.parameters())  # freed after the update
    assert results[True][0] < results[False][0] == sum(len(x) for x in ids)  # the prompts were computed once
    for a, b in zip(results[True][1] + results[True][2], results[False][1] + results[False][2]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert any(float(g.abs().max()) > 0 for g in results[True][3])
    for a, b in zip(results[True][3], results[False][3]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-3)
