"""The multi-turn rollout loop (StarPO's rollout stage, arXiv 2504.20073 Sec. 3).

For P env groups x N trajectories: reset the batched env from the group seeds, build each
group's prompt once, let the engine sample every live trajectory's response in one batch,
parse the answers, step the env, append the reward and next state as the next user
message, and repeat for up to `max_turns` turns.

Token-in-token-out: a trajectory's ids are the prompt ids, then per turn the sampled ids
exactly as generated (loss mask True, with their sampling log-probs), then the ids of the
template text between turns (end-of-turn token unless the model sampled it, separators,
the next user message, the assistant header and the prime; loss mask False). Model tokens
are decoded only to read the answer, never re-encoded.

Format penalty (RAGEN): a turn whose answer is missing, malformed (see parsing.py) or holds
an invalid action gets `format_penalty` added to its reward and still counts as a turn.
With `run_valid_actions_on_format_error=True` (default, as RAGEN) the valid actions of such
an answer are still executed; with False the turn executes nothing.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .batch import RolloutConfig, TrajectoryBatch
from .engine import STOP_CONTEXT
from .parsing import parse_response
from .prompts import ChatFormat, first_user_message, next_user_message
from .sampling import SamplingParams


class MultiTurnRollout:
    """Generates TrajectoryBatches for one environment with one engine.

    Args:
        engine: NativeEngine or SGLangEngine (the session interface: start / generate /
            finish / session_length / stats).
        tokenizer: the model's tokenizer (chat template required).
        env_name: "bandit", "sokoban" or "frozenlake" (fastpo.envs_native.make_env).
        env_config: keyword arguments for the environment.
        cfg: RolloutConfig.
    Raises ValueError for a bad config or environment name (from make_env, at first use).
    """

    def __init__(self, engine, tokenizer, env_name: str, env_config: dict | None = None, cfg: RolloutConfig | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env_name = env_name
        self.env_config = dict(env_config or {})
        self.cfg = cfg if cfg is not None else RolloutConfig()
        if not isinstance(self.cfg, RolloutConfig):
            raise TypeError(f"cfg must be a RolloutConfig, got {type(self.cfg).__name__}")
        self.chat = ChatFormat(tokenizer, think=self.cfg.think, system_prompt=self.cfg.system_prompt)
        from fastpo.envs_native import ENV_NAMES

        if env_name not in ENV_NAMES:
            raise ValueError(f"unknown environment {env_name!r}; choose one of {ENV_NAMES}")

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        """The engine settings for one turn under this config."""
        c = self.cfg
        return SamplingParams(
            temperature=c.temperature if temperature is None else temperature, top_p=c.top_p, top_k=c.top_k,
            max_new_tokens=c.max_new_tokens, stop_token_ids=tuple(self.chat.eot_token_ids),
            stop_strings=("</answer>",) if c.stop_at_answer_close else (), max_context=c.max_context,
        )

    def _response_text(self, ids: list) -> tuple:
        """(text for parsing = prime + decoded response without a final stop token,
        whether that stop token is the template's own end-of-turn token)."""
        stop = bool(ids) and ids[-1] in self.chat.eot_token_ids
        body = ids[:-1] if stop else ids
        eot = stop and ids[-1] == self.chat.template_eot_id
        return self.chat.prime + self.tokenizer.decode(body, skip_special_tokens=False), eot

    def generate(self, seeds, group_size: int, temperature: float | None = None, seed: int = 0) -> TrajectoryBatch:
        """Roll out len(seeds) env groups x group_size trajectories.

        seeds: P non-negative ints, one env group per seed; the group's trajectories all
        reset from it and share one prefill of their common prompt. group_size: N >= 1.
        temperature: overrides cfg.temperature (e.g. 0.5 for evaluation). seed: seeds the
        sampler (torch.Generator on the model's device): the same call gives the same batch.

        Returns a TrajectoryBatch of B = P * N trajectories, ordered group by group, with
        metrics: seconds, prefilled_tokens, generated_tokens, tokens_per_s (generated / s),
        response_length (mean tokens per turn), num_turns, success_rate, score,
        valid_action_rate (recognised / all answer pieces), effective_action_rate (actions
        that changed the state / executed), format_penalty_rate (penalised / all turns),
        truncated_rate. Raises ValueError for bad seeds or group_size.
        """
        from fastpo.envs_native import make_env

        cfg = self.cfg
        seeds = [int(s) for s in seeds]
        if not seeds or any(s < 0 for s in seeds):
            raise ValueError(f"seeds must be a non-empty list of non-negative integers, got {seeds!r:.100}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        t0 = time.perf_counter()
        P, N = len(seeds), group_size
        B = P * N
        params = self.sampling_params(temperature)
        env = make_env(self.env_name, B, **self.env_config)
        traj_seeds = np.repeat(np.asarray(seeds, dtype=np.int64), N)
        obs = env.reset(traj_seeds)
        instructions = env.instructions()
        think, k_turn = cfg.think, cfg.max_actions_per_turn
        users = [[first_user_message(instructions[b], obs[b], cfg.max_actions_per_traj, k_turn, think, cfg.max_new_tokens)]
                 for b in range(B)]
        group_prompts = [self.chat.prompt_ids(users[g * N][0]) for g in range(P)]

        ids = [list(group_prompts[b // N]) for b in range(B)]
        mask = [[False] * len(x) for x in ids]
        lps = [[0.0] * len(x) for x in ids]
        tix = [[-1] * len(x) for x in ids]
        responses = [[] for _ in range(B)]
        resp_texts = [[] for _ in range(B)]
        T = cfg.max_turns
        turn_rewards = np.zeros((B, T), dtype=np.float32)
        penalties = np.zeros((B, T), dtype=np.float32)
        num_turns = np.zeros(B, dtype=np.int64)
        actions_left = np.full(B, cfg.max_actions_per_traj, dtype=np.int64)
        truncated = np.zeros(B, dtype=bool)
        stop_reason = [""] * B
        n_pieces = n_valid = n_exec = n_effective = n_penalised = n_turns_total = n_resp_tokens = 0

        engine = self.engine
        engine.reset_stats()
        device = engine.device
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed))
        # A prompt that cannot fit one response token is truncated before turn 1.
        for b in range(B):
            if len(ids[b]) + 1 > cfg.max_context:
                truncated[b] = True
                stop_reason[b] = STOP_CONTEXT
        active = [b for b in range(B) if not truncated[b]]
        if active:
            engine.start(group_prompts, N)
        append = None
        for turn in range(T):
            if not active:
                break
            outs = engine.generate(active, append, params, gen)
            answers = [""] * B
            run_mask = np.zeros(B, dtype=bool)
            fmt_ok = np.zeros(B, dtype=bool)
            has_answer = np.zeros(B, dtype=bool)
            emitted_eot = {}
            ended = set()
            for b, out in zip(active, outs):
                if not out.token_ids:  # no room for even one token: the turn did not happen
                    truncated[b] = True
                    stop_reason[b] = STOP_CONTEXT
                    ended.add(b)
                    continue
                r = out.token_ids
                ids[b].extend(r)
                mask[b].extend([True] * len(r))
                lps[b].extend(float(x) for x in out.logprobs)
                tix[b].extend([turn] * len(r))
                responses[b].append(torch.tensor(r, dtype=torch.long))
                text, eot = self._response_text(r)
                emitted_eot[b] = eot
                resp_texts[b].append(text)
                parsed = parse_response(text, think=think)
                answers[b] = parsed.answer or ""
                has_answer[b] = parsed.answer is not None
                fmt_ok[b] = parsed.format_ok
                run_mask[b] = True
                num_turns[b] += 1
                n_resp_tokens += len(r)
                if out.stop_reason == STOP_CONTEXT:
                    truncated[b] = True
                    stop_reason[b] = STOP_CONTEXT
            stepped = [b for b in active if run_mask[b]]
            if not stepped:
                active = [b for b in active if b not in ended]
                continue
            pa = env.parse_actions(answers, k_turn)
            acts = pa.actions.copy()
            for b in range(B):
                lim = int(min(k_turn, actions_left[b]))
                acts[b, lim:] = -1
            ok = fmt_ok & pa.all_valid & has_answer
            run_actions = ok | (has_answer & bool(cfg.run_valid_actions_on_format_error))
            acts[~run_actions] = -1
            res = env.step(acts, active=run_mask)
            for b in stepped:
                pen = 0.0 if ok[b] else float(cfg.format_penalty)
                penalties[b, turn] = pen
                turn_rewards[b, turn] = float(res.reward[b]) + pen
                actions_left[b] -= int(res.num_executed[b])
                n_pieces += int(pa.num_actions[b]) + len(pa.invalid[b])
                n_valid += int(pa.num_actions[b])
                n_exec += int(res.num_executed[b])
                n_effective += int(res.effective[b].sum())
                n_penalised += int(not ok[b])
                n_turns_total += 1
            obs_now = None
            new_active, new_append = [], []
            for b in active:
                if b in ended:
                    continue
                if truncated[b]:
                    continue
                if bool(res.done[b]):
                    stop_reason[b] = "env_done"
                    continue
                if actions_left[b] <= 0:
                    stop_reason[b] = "action_budget"
                    continue
                if turn == T - 1:
                    stop_reason[b] = "max_turns"
                    continue
                if obs_now is None:
                    obs_now = env.render()
                note = ""
                if cfg.feedback_invalid and not ok[b]:
                    note = ("Invalid actions: " + ", ".join(pa.invalid[b]) + ".") if pa.invalid[b] else \
                        "Your answer was not in the required format."
                msg = next_user_message(turn + 2, float(turn_rewards[b, turn]), obs_now[b], int(actions_left[b]),
                                        think, cfg.max_new_tokens, note=note)
                between = self.chat.between_turn_ids(msg, emitted_eot.get(b, False))
                if len(ids[b]) + len(between) + 1 > cfg.max_context:
                    truncated[b] = True
                    stop_reason[b] = STOP_CONTEXT
                    continue
                users[b].append(msg)
                ids[b].extend(between)
                mask[b].extend([False] * len(between))
                lps[b].extend([0.0] * len(between))
                tix[b].extend([-1] * len(between))
                new_active.append(b)
                new_append.append(between)
            active, append = new_active, new_append
        engine.finish()
        for b in range(B):
            if not stop_reason[b]:
                stop_reason[b] = "max_turns"
        seconds = time.perf_counter() - t0
        stats = engine.stats
        scores = turn_rewards.sum(1)
        metrics = {
            "seconds": seconds,
            "engine_seconds": float(stats.get("seconds", 0.0)),
            "prefilled_tokens": float(stats["prefilled_tokens"]),
            "generated_tokens": float(stats["generated_tokens"]),
            "tokens_per_s": float(stats["generated_tokens"]) / max(seconds, 1e-9),
            "response_length": n_resp_tokens / max(1, n_turns_total),
            "num_turns": float(num_turns.mean()),
            "success_rate": float(env.success.mean()),
            "score": float(scores.mean()),
            "valid_action_rate": n_valid / max(1, n_pieces),
            "effective_action_rate": n_effective / max(1, n_exec),
            "format_penalty_rate": n_penalised / max(1, n_turns_total),
            "truncated_rate": float(truncated.mean()),
            "num_actions": float((cfg.max_actions_per_traj - actions_left).mean()),
        }
        return TrajectoryBatch(
            input_ids=[torch.tensor(x, dtype=torch.long) for x in ids],
            loss_mask=[torch.tensor(x, dtype=torch.bool) for x in mask],
            sample_logprobs=[torch.tensor(x, dtype=torch.float32) for x in lps],
            turn_index=[torch.tensor(x, dtype=torch.long) for x in tix],
            turn_rewards=torch.from_numpy(turn_rewards), format_penalty=torch.from_numpy(penalties),
            num_turns=torch.from_numpy(num_turns), scores=torch.from_numpy(scores.astype(np.float32)),
            success=torch.from_numpy(env.success.copy()),
            num_actions=torch.from_numpy((cfg.max_actions_per_traj - actions_left).astype(np.int64)),
            group_ids=torch.arange(P).repeat_interleave(N), seeds=torch.from_numpy(traj_seeds.copy()),
            truncated=torch.from_numpy(truncated), stop_reason=stop_reason, responses=responses,
            response_texts=resp_texts, metrics=metrics, user_messages=users, tokenizer=self.tokenizer,
            info={"env": self.env_name, "group_size": N, "num_groups": P},
        )
