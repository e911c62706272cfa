"""The rollout runner: the generation engine and the multi-turn rollout over it, used for the
training batches (`generate`) and for the evaluation on the fixed eval seeds (`evaluate`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable, Optional

import torch

from fastpo.distributed.collectives import on_main

from fastpo.distributed.context import DistContext
from fastpo.config.schema import TrainConfig
from fastpo.evaluate import config_success_bounds, evaluate_config, write_json
from fastpo.report.metrics import write_samples
from fastpo.trainer.models import Models
from fastpo.trainer.plan import RunPlan


def make_engine(cfg: TrainConfig, models: Models):
    """The generation engine of `rollout.engine`: the native one samples from the policy module
    itself; SGLang's holds a copy, refreshed by `Sampler.awake` after each update."""
    from fastpo import rollout as ro

    model, tok = models.policy, models.tokenizer
    if cfg.rollout.engine == "native":
        return ro.NativeEngine(model, tok)
    import tempfile

    from fastpo.rollout.sglang_engine import SGLangEngine

    # SGLang loads the weights from an HF folder once; later updates go as tensors, so the
    # folder (a full copy of the model) lives only until the engine has started
    folder = tempfile.mkdtemp(prefix="fastpo-sglang-")
    try:
        return SGLangEngine.from_model(model, tok, folder, mem_fraction_static=cfg.rollout.sglang_mem_fraction,
                                       dtype="float32" if cfg.model.dtype == "float32" else "bfloat16")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Sampler:
    """Trajectories from the current policy: `generate` (training batches) and `evaluate` (the
    fixed eval seeds), the engine kept in step with the trained weights (`weights_changed`).

    `rollout`: a `fastpo.rollout.MultiTurnRollout` over `engine`; `out`: the run folder (eval
    outcomes and samples are written there); `warn(text)`: the run's user warnings;
    `stopping()`: whether a stop asks the work under way to end (the rollout's `stop_check`,
    asked between turns; the caller then drops the work)."""

    def __init__(self, cfg: TrainConfig, dist: DistContext, models: Models, engine, rollout, plan: RunPlan,
                 out: str, warn: Callable[[str], None], stopping: Callable[[], bool] = lambda: False):
        self.cfg, self.dist, self.models, self.engine, self.rollout = cfg, dist, models, engine, rollout
        self.plan, self.out, self.warn, self.stopping = plan, out, warn, stopping
        self._released = self._stale = False
        self.weight_sync_seconds = 0.0  # since the last `take_weight_sync_seconds`
        self._success_bounds: Optional[dict] = None  # eval/optimal_success, eval/random_success (fixed seeds)

    def take_weight_sync_seconds(self) -> float:
        """Seconds spent loading new weights into the engine since the last call."""
        s, self.weight_sync_seconds = self.weight_sync_seconds, 0.0
        return s

    def weights_changed(self) -> None:
        """After an update: an engine with its own copy (SGLang) loads them before it next generates."""
        self._stale = True

    def shutdown(self) -> None:
        """Stop an engine that runs its own processes (SGLang); the native one has none."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    @contextlib.contextmanager
    def awake(self):
        """Around generation: an engine that frees its GPU memory for training (SGLang) takes
        it back and loads the weights of the last update first, and frees it again after."""
        if not hasattr(self.engine, "release_memory"):
            yield  # the native engine is the trained module: nothing to move
            return
        if self._released:
            self.engine.resume_memory()
            self._released = False
        if self._stale:
            t0 = time.perf_counter()
            self.engine.update_weights(self.models.policy)
            self._stale = False
            self.weight_sync_seconds += time.perf_counter() - t0
        try:
            yield
        finally:
            self.engine.release_memory()
            self._released = True

    def generate(self, seeds: list[int], group_size: int, temperature: float, seed: int,
                 group_ids: Optional[list[int]] = None):
        """Roll out env groups `seeds` x group_size (a TrajectoryBatch); `group_ids` (global
        ids): each group samples from its own stream (rollout.sampling_streams), else one
        stream for the batch (sampling seed `seed`)."""
        m = self.models
        m.policy.eval()
        # old log-probs from the sampler: a critic on the policy's trunk reads its values off
        # the sampling pass's hidden states, so no pass over the batch is left to do
        readout = (self.plan.old_logprob_source == "sampler" and m.value_head is not None
                   and m.critic_body is None and hasattr(self.engine, "readout"))
        if readout:
            self.engine.readout = m.value_head
        try:
            with torch.no_grad(), m.autocast(), self.awake():
                if group_ids is None:
                    return self.rollout.generate(seeds, group_size, temperature=temperature, seed=seed)
                return self.rollout.generate(seeds, group_size, temperature=temperature, seed=seed,
                                             group_ids=group_ids)
        finally:
            if readout:
                self.engine.readout = None

    def evaluate(self, it: int) -> dict:
        """Success rate and pass@k on the fixed eval seeds at the eval temperature, with the
        best and the random policy's success on the same seeds and horizon beside it
        (`eval/optimal_success`, `eval/random_success`, computed once); writes samples and the
        per-trajectory outcomes. Several processes: collective, every rank evaluates its share
        of the seeds (`evaluate_config`), rank 0 writes the files, each rank's seed count and
        rollout seconds are `dist/rank<R>/eval_seeds` and `eval_rollout_s`, and every rank
        gets the metrics. Returns {} when `stopping()` ended it (nothing written)."""
        t = self.cfg.trainer
        t0 = time.perf_counter()
        with self.awake():
            res, batch = evaluate_config(self.rollout, self.cfg, autocast=self.models.autocast,
                                         model=self.models.policy, dist=self.dist)
        if self.stopping():  # ended early: the caller drops it, nothing is written
            return {}
        ranks = res.pop("_ranks")
        per_traj = res.pop("_per_trajectory")

        def record() -> dict:
            if self._success_bounds is None:  # fixed seeds: computed once (a Sokoban search past its cap: none)
                self._success_bounds = config_success_bounds(self.cfg, warn=self.warn)
            res.update(self._success_bounds)
            # per-trajectory outcomes, for the paired before/after comparison (metrics.before_after)
            write_json(os.path.join(self.out, "eval", f"iter_{it:06d}.json"), per_traj)
            write_samples(os.path.join(self.out, "samples"), it, batch.texts()[: max(1, t.num_samples)],
                          header=f"eval at iteration {it}: success rate {res['eval/success_rate']:.3f} "
                                 f"(temperature {t.eval_temperature}, {t.eval_seeds} seeds)",
                          model_label=self.models.info.label if it == 0 else self.models.info.trained_label())
            if self.dist.initialized:
                for r, info in enumerate(ranks):
                    res[f"dist/rank{r}/eval_seeds"] = info["seeds"]
                    res[f"dist/rank{r}/eval_rollout_s"] = info["seconds"]
            res["time/eval_s"] = time.perf_counter() - t0
            return res

        return on_main(self.dist, record)

    def collapse_metrics(self, batch) -> dict:
        """`collapse/*` (fastpo/trainer/collapse.py) of a rollout batch's first turns, scored by the
        current policy at the rollout temperature with the trainer's packing and kernels."""
        from fastpo.trainer.collapse import batch_collapse_metrics

        r = self.cfg.rollout
        return batch_collapse_metrics(self.models.policy, self.models.tokenizer, batch, think=r.think,
                                      temperature=r.temperature, token_budget=self.cfg.optim.micro_token_budget,
                                      share_prompt=self.cfg.optim.share_prefix, impl=self.cfg.trainer.kernel_impl,
                                      autocast=self.models.autocast)
