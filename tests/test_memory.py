"""Host memory of the training process (fastpo.memory): freed tensors go back to the system,
and the trainer turns that on and frees its gradients once the optimizer has stepped."""
import subprocess
import sys
import textwrap

import pytest

from fastpo import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or memory._libc() is None,
                                reason="glibc's malloc and /proc (Linux) only")

# A phase that frees 8 MiB activations after a 16 MiB tensor was freed (which raises glibc's
# dynamic mmap threshold past 8 MiB), keeping the last one: the resident set afterwards, less
# the one kept, is what the heap hoards.
_PATTERN = textwrap.dedent("""
    import sys, torch
    from fastpo import memory
    if sys.argv[1] == "bounded":
        assert memory.bound_heap()
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    big = torch.ones(4 * 2**20)  # 16 MiB, mapped
    del big                      # (its unmapping raises the dynamic threshold to 16 MiB)
    start = rss()
    acts = [torch.ones(2 * 2**20) for _ in range(48)]  # 48 x 8 MiB
    keep = acts[-1]
    del acts
    print((rss() - start) / 2**20)
""")


def _hoarded_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PATTERN, mode], capture_output=True, text=True, timeout=120,
                         env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


def test_bound_heap_returns_freed_tensors_to_the_system():
    """Unbounded, glibc keeps the 47 freed 8 MiB tensors resident (the pattern is real);
    with `bound_heap` only the one still referenced stays."""
    assert _hoarded_mib("default") > 200
    assert _hoarded_mib("bounded") < 40


def test_bound_heap_refuses_a_threshold_glibc_would_not_take():
    with pytest.raises(ValueError, match="33554433"):
        memory.bound_heap(32 * 2**20 + 1)


def test_trainer_run_bounds_the_heap_before_loading_anything(tmp_path, monkeypatch):
    """`Trainer.run` fixes the threshold before its set-up allocates the model (allocations
    made before keep their place in the heaps)."""
    from rich.console import Console

    import fastpo.trainer.loop as loop
    from fastpo.config import load_config

    calls = []

    class Stop(Exception):
        pass

    def setup(self):
        calls.append("setup")
        raise Stop

    monkeypatch.setattr(loop, "bound_heap", lambda: calls.append("bound_heap") or True)
    monkeypatch.setattr(loop.Trainer, "setup", setup)
    cfg = load_config(env="frozenlake", preset="tiny",
                      overrides=[f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama"])
    with pytest.raises(Stop):
        loop.Trainer(cfg, console=Console(quiet=True)).run()
    assert calls == ["bound_heap", "setup"]


def test_gradient_checkpointing_update_is_bit_identical(tmp_path):
    """The CPU preset recomputes activations in the backward (model.gradient_checkpointing):
    the update's gradients are the same bits as with the activations kept, so only memory and
    time change."""
    import dataclasses

    import torch
    from rich.console import Console

    from fastpo.config import load_config
    from fastpo.trainer import Trainer
    from fastpo.trainer.batch import TrainBatch

    assert load_config(env="frozenlake", preset="cpu").model.gradient_checkpointing
    cfg = load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "rollout.max_new_tokens=8",
        "trainer.plots=false"])
    tr = Trainer(cfg, console=Console(quiet=True))
    tr.setup()
    rollout = tr._generate([3], 2, 1.0, seed=0)
    record = TrainBatch.from_rollout(rollout, 1)
    old_lp, _, vals, _ = tr.compute_old(record)
    adv, returns, _ = tr.compute_advantages(rollout, record.loss_mask, vals)
    record = dataclasses.replace(record, old_logprobs=old_lp, values=vals, advantages=adv, returns=returns)
    start = {k: v.clone() for k, v in tr.model.state_dict().items()}
    grads, step = {}, tr._optimizer_step

    def keep(metrics):
        grads[ckpt] = [p.grad.clone() for p in tr.model.parameters()]
        return False  # no step: both updates start from the same weights

    tr._optimizer_step = keep
    for ckpt in (False, True):
        tr.model.load_state_dict(start)
        (tr.model.gradient_checkpointing_enable if ckpt else tr.model.gradient_checkpointing_disable)()
        tr.update(1, record)
    tr._optimizer_step = step
    assert any(float(g.abs().max()) > 0 for g in grads[False])
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
