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

Each turn's answers are parsed, run and scored by `fastpo.rollout.turns.env_turn` (the format
penalty and `cfg.format_rule` are described there). The text parsed is cut after the first
stop string (e.g. "</answer>" when the token completing it was ">."); the sampled ids are
kept as they are.

Context window (cfg.context_window = K): before turn j > K the engine evicts turn j-K's
tokens from the session (positions kept), and the batch records per token its turn and the
oldest turn it saw (`context_turns`, `visible_from`; fastpo/rollout/window.py), which the trainer
turns into the same attention. `refill_window = True` (benchmark baseline only, not
trainable) instead re-prefills the kept turns each turn with fresh positions.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

import fastpo.rollout.window as ctxwin
from fastpo.config.schema import RolloutConfig, context_window_turns
from fastpo.config.members import env_members, member_rollout_config
from fastpo.envs import assign_members, make_env, resolve_env
from fastpo.envs.mixture import EnvMember
from fastpo.seeds import group_sampling_seed

from .engine import STOP_CONTEXT
from .parsing import cut_at_stop
from .prompts import ChatFormat, first_user_message, next_user_message
from .sampling import SamplingParams
from .trajectory_batch import TrajectoryBatch
from .turns import EnvTurn, TurnCounters, closing_question, end_reason, env_turn, merged_turn


@dataclasses.dataclass
class _Part:
    """The trajectories of one game of a rollout: `idx` (int64, ascending) of the batch, played
    by `env` (len(idx) instances, instance i is trajectory idx[i]) under `cfg`."""

    member: EnvMember
    cfg: RolloutConfig
    env: object
    idx: np.ndarray


@dataclasses.dataclass
class _Rollout:
    """The state of one `generate` call: per trajectory b, its token ids and their
    per-token records, its turns, rewards and why it stopped (B = P * N, group by group)."""

    P: int
    N: int
    parts: list  # the games played (_Part), one for a single game
    seeds: np.ndarray  # int64 [B], each trajectory's env seed
    users: list  # B lists of user messages
    group_prompts: list  # P prompt id lists
    ids: list
    turn_limit: np.ndarray  # int64 [B], each trajectory's max_turns (its game's)
    max_actions: np.ndarray  # int64 [B], each trajectory's action budget (its game's)
    mask: list = None
    lps: list = None
    ents: list = None
    vals: list = None
    tix: list = None
    window: dict = None  # context-window bookkeeping (window.py): heads, wturn, wfed, starts, special

    def __post_init__(self):
        B, T = len(self.ids), self.turns
        self.part_of = np.zeros(B, dtype=np.int64)  # trajectory b is instance pos[b] of parts[part_of[b]]
        self.pos = np.zeros(B, dtype=np.int64)
        for k, part in enumerate(self.parts):
            self.part_of[part.idx] = k
            self.pos[part.idx] = np.arange(len(part.idx))
        self.mask = [[False] * len(x) for x in self.ids]
        self.lps = [[0.0] * len(x) for x in self.ids]
        self.ents = [[0.0] * len(x) for x in self.ids]
        self.vals = [[0.0] * len(x) for x in self.ids]
        self.recorded = {"entropies": True, "values": True}  # did the engine record them for every token?
        self.tix = [[-1] * len(x) for x in self.ids]
        self.responses = [[] for _ in range(B)]
        self.resp_texts = [[] for _ in range(B)]
        self.turn_stops = [[] for _ in range(B)]
        self.valid_n = np.zeros(B, dtype=np.int64)
        self.invalid_n = np.zeros(B, dtype=np.int64)
        self.effective_n = np.zeros(B, dtype=np.int64)
        self.penalised_n = np.zeros(B, dtype=np.int64)
        self.turn_rewards = np.zeros((B, T), dtype=np.float32)
        self.penalties = np.zeros((B, T), dtype=np.float32)
        self.num_turns = np.zeros(B, dtype=np.int64)
        self.actions_left = self.max_actions.copy()
        self.truncated = np.zeros(B, dtype=bool)
        self.stop_reason = [""] * B
        self.counters = TurnCounters()

    @property
    def B(self) -> int:
        return len(self.ids)

    @property
    def turns(self) -> int:
        """T: the most turns any trajectory may take."""
        return int(self.turn_limit.max()) if len(self.turn_limit) else 0

    def part(self, b: int) -> _Part:
        return self.parts[int(self.part_of[b])]

    @property
    def success(self) -> np.ndarray:
        """bool [B]: whether each trajectory's game is won."""
        out = np.zeros(self.B, dtype=bool)
        for part in self.parts:
            out[part.idx] = part.env.success
        return out

    def stop(self, b: int, reason: str) -> None:
        if reason == STOP_CONTEXT:
            self.truncated[b] = True
        self.stop_reason[b] = reason

    def extend_template(self, b: int, between: list) -> None:
        """Append template ids (loss mask 0, no log-prob, no turn) to trajectory b."""
        n = len(between)
        self.ids[b].extend(between)
        self.mask[b].extend([False] * n)
        self.lps[b].extend([0.0] * n)
        self.ents[b].extend([0.0] * n)
        self.vals[b].extend([0.0] * n)
        self.tix[b].extend([-1] * n)


class MultiTurnRollout:
    """Generates TrajectoryBatches for one environment, or a mixture of several, with one engine.

    Args:
        engine: NativeEngine or SGLangEngine (the session interface: start / generate /
            finish / session_length / stats).
        tokenizer: the model's tokenizer (chat template required).
        env_name: any name `fastpo.envs.make_env` takes: "bandit", "sokoban", "frozenlake",
            "module.path:Class", "textarena:ID", "gym:ID" or an installed entry point; with
            `members`, a label for the whole ("mixture").
        env_config: the environment's options.
        cfg: RolloutConfig (with `members`: the settings the games share: sampling, prompt,
            context).
        env_workers: worker processes stepping a plain-Python env (0: in process).
        members: None (the one game `env_name`), or several games as (fastpo.envs.EnvMember,
            its RolloutConfig) pairs: each env group plays the member
            `fastpo.envs.assign_members` draws from its seed, with that member's options, turn
            and action limits and format penalty; every live trajectory of every game still
            samples in one engine batch per turn.
    Raises ValueError (fastpo.envs.EnvError) for a bad config or environment name.

    `stop_check`: None, or a callable asked before each turn (the trainer's SIGTERM flag,
    `fastpo.trainer.lifecycle.StopControl.dropping`); True ends the rollout there, and the
    batch `generate` returns is cut short (its caller drops it).
    """

    def __init__(self, engine, tokenizer, env_name: str, env_config: dict | None = None, cfg: RolloutConfig | None = None,
                 env_workers: int = 0, members: list | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env_name = env_name
        self.env_config = dict(env_config or {})
        self.env_workers = int(env_workers)
        self.cfg = cfg if cfg is not None else RolloutConfig()
        if not isinstance(self.cfg, RolloutConfig):
            raise TypeError(f"cfg must be a RolloutConfig, got {type(self.cfg).__name__}")
        if members is None:
            resolve_env(env_name)
            members = [(EnvMember(env_name, env_name, 1.0, self.env_config, {}), self.cfg)]
        elif not members or not all(isinstance(m, EnvMember) and isinstance(c, RolloutConfig) for m, c in members):
            raise TypeError("members must be a non-empty list of (EnvMember, RolloutConfig) pairs")
        else:
            for m, _ in members:
                resolve_env(m.name)
        self.members = list(members)
        self.chat = ChatFormat(tokenizer, think=self.cfg.think, system_prompt=self.cfg.system_prompt)
        self.window = context_window_turns(self.cfg.context_window, "RolloutConfig.context_window")
        if self.window is not None and engine is not None and not hasattr(engine, "evict"):
            raise ValueError(f"rollout.context_window={self.cfg.context_window!r} needs an engine that evicts KV "
                             f"entries (the native engine); {type(engine).__name__} does not")
        self.refill_window = False  # benchmark baseline: re-prefill the window each turn (not trainable)
        self.stop_check = None

    @classmethod
    def from_config(cls, cfg, engine, tokenizer) -> "MultiTurnRollout":
        """The rollout of TrainConfig `cfg` (its env or env.mixture, its rollout settings) over
        `engine` (None: prompts only, e.g. `prompt_lengths`)."""
        shared = cfg.rollout.rollout_config()
        if not cfg.env.mixture:
            return cls(engine, tokenizer, cfg.env.name, dict(cfg.env.options), shared, env_workers=cfg.env.workers)
        members = [(m, member_rollout_config(cfg, m)) for m in env_members(cfg)]
        return cls(engine, tokenizer, cfg.env.name, {}, shared, env_workers=cfg.env.workers, members=members)

    @property
    def mixed(self) -> bool:
        """Whether this rollout plays several games."""
        return len(self.members) > 1

    def only(self, label: str) -> "MultiTurnRollout":
        """A rollout over the same engine playing only member `label` (e.g. to evaluate one
        game of a mixture); KeyError for an unknown label."""
        for m, c in self.members:
            if m.label == label:
                ro = MultiTurnRollout(self.engine, self.tokenizer, m.name, m.options, c, self.env_workers,
                                      members=[(m, c)])
                ro.refill_window, ro.stop_check = self.refill_window, self.stop_check
                return ro
        raise KeyError(f"no env {label!r} in this rollout; it plays {[m.label for m, _ in self.members]}")

    def make_env(self, batch_size: int, member: EnvMember | None = None):
        """B instances of this rollout's env, or of `member`'s (`fastpo.envs.make_env`)."""
        m = member if member is not None else self.members[0][0]
        return make_env(m.name, batch_size, m.options, workers=self.env_workers)

    def _parts(self, seeds: list, N: int) -> list:
        """The games of env groups `seeds` x N trajectories (each group's member drawn from its
        seed), each with its instances built: [_Part], the members in their order."""
        which = assign_members(seeds, [m for m, _ in self.members]) if self.mixed else [0] * len(seeds)
        parts = []
        try:
            for k, (m, c) in enumerate(self.members):
                groups = [g for g, w in enumerate(which) if w == k]
                if groups:
                    idx = np.asarray([g * N + i for g in groups for i in range(N)], dtype=np.int64)
                    parts.append(_Part(m, c, self.make_env(len(idx), m), idx))
        except BaseException:
            for part in parts:
                _close(part.env)
            raise
        return parts

    def _reset(self, parts: list, traj_seeds: np.ndarray) -> list:
        """Reset every part's instances from their trajectories' seeds; the B first user messages."""
        users = [None] * len(traj_seeds)
        for part in parts:
            obs = part.env.reset(traj_seeds[part.idx])
            for b, msg in zip(part.idx, self._first_messages(part.env, obs, part.cfg)):
                users[b] = msg
        return users

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        """The engine settings for one turn under this config."""
        c = self.cfg
        return SamplingParams(
            temperature=c.temperature if temperature is None else temperature, top_p=c.top_p, top_k=c.top_k,
            max_new_tokens=c.max_new_tokens, stop_token_ids=tuple(self.chat.eot_token_ids),
            stop_strings=("</answer>",) if c.stop_at_answer_close else (), max_context=c.max_context,
        )

    def _response_text(self, ids: list, stop_strings: tuple = ()) -> tuple:
        """(text for parsing = prime + decoded response without a final stop token, cut
        after the first stop string, whether that stop token is the template's own
        end-of-turn token)."""
        stop = bool(ids) and ids[-1] in self.chat.eot_token_ids
        body = ids[:-1] if stop else ids
        eot = stop and ids[-1] == self.chat.template_eot_id
        text = self.chat.prime + self.tokenizer.decode(body, skip_special_tokens=False)
        return cut_at_stop(text, stop_strings), eot

    def _first_messages(self, env, obs, cfg: RolloutConfig | None = None) -> list:
        """Turn 1's user message of each trajectory of the freshly reset `env` (states `obs`),
        under `cfg` (its game's; default: this rollout's)."""
        c = cfg if cfg is not None else self.cfg
        instructions = env.instructions()
        free = bool(getattr(env, "free_text", False))
        return [first_user_message(instructions[b], obs[b], c.max_actions_per_traj, c.max_actions_per_turn, c.think,
                                   c.max_new_tokens, env.action_names(b), question=self._question(env, b, c),
                                   free_text=free)
                for b in range(len(obs))]

    def _question(self, env, b: int, cfg: RolloutConfig | None = None) -> str:
        return closing_question(cfg if cfg is not None else self.cfg, env.action_names(b))

    def prompt_lengths(self, seeds) -> list:
        """Tokens of the first prompt (chat template, system and first user message, assistant
        header and prime) of the env group of each of `seeds` (in a mixture: of the game its
        seed draws); needs the tokenizer, not the engine. Raises ValueError for bad seeds,
        like `generate`."""
        seeds = _check_seeds(seeds)
        parts = self._parts(seeds, 1)
        try:
            return [len(self.chat.prompt_ids(m)) for m in self._reset(parts, np.asarray(seeds, dtype=np.int64))]
        finally:
            for part in parts:
                _close(part.env)

    def generate(self, seeds, group_size: int, temperature: float | None = None, seed: int = 0,
                 group_ids: list | None = None) -> TrajectoryBatch:
        """Roll out len(seeds) env groups x group_size trajectories.

        seeds: P non-negative ints, one env group per seed; the group's trajectories all
        reset from it and share one prefill of their common prompt. group_size: N >= 1.
        temperature: overrides cfg.temperature (e.g. 0.5 for evaluation). seed: seeds the
        sampler (torch.Generator on the model's device): the same call gives the same batch.
        group_ids: None (one sampling stream for the whole batch), or P distinct ints >= 0, the
        env groups' ids (e.g. their index in a batch split over processes): group p's
        trajectories then draw from their own stream, seeded by
        `fastpo.seeds.group_sampling_seed(seed, group_ids[p])`, so a group samples the same
        tokens whatever other groups share the call, and the batch's `group_ids` are these.

        Returns a TrajectoryBatch of B = P * N trajectories, ordered group by group, with
        metrics: seconds, prefilled_tokens, generated_tokens, tokens_per_s (generated / s),
        response_length (mean tokens per turn), num_turns, success_rate, score,
        valid_action_rate (recognised / all answer pieces), effective_action_rate (actions
        that changed the state / executed), format_penalty_rate (penalised / all turns),
        truncated_rate, and the engine's KV memory: peak_kv_bytes (the most it held, bytes)
        and peak_kv_token_bytes (the most bytes of tokens it held at one moment, a shared
        prompt counted once). Per trajectory the batch also holds each turn's engine stop reason
        and its valid / invalid / effective action and penalised-turn counts.
        Raises ValueError for bad seeds (not a non-empty sequence of non-negative integers:
        floats, bools and strings are refused, not truncated), a bad `seed` or group_size;
        fastpo.envs.EnvError from a plain-Python env's reset/step (naming the env and seed).
        """
        seeds = _check_seeds(seeds)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed (the sampler seed) must be an integer, got {seed!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        t0 = time.perf_counter()
        params = self.sampling_params(temperature)
        parts = self._parts(seeds, group_size)
        try:
            st = self._start(parts, seeds, group_size)
            engine = self.engine
            engine.reset_stats()
            gen, labels = self._sampling_streams(st.P, st.N, seed, group_ids, engine.device)
            self._turns(st, params, gen)
            engine.finish()
            st.final_obs = [None] * st.B  # each instance's state after its trajectory's last turn
            for part in parts:
                for b, text in zip(part.idx, part.env.render()):
                    st.final_obs[b] = text
        finally:
            for part in parts:
                _close(part.env)
        for b in range(st.B):
            if not st.stop_reason[b]:
                st.stop_reason[b] = "max_turns"
        return self._batch(st, labels, time.perf_counter() - t0)

    def _start(self, parts: list, seeds: list, N: int) -> _Rollout:
        """Reset the P x N instances and build each group's first prompt (and the context-
        window bookkeeping); a prompt that cannot fit one response token is truncated."""
        P = len(seeds)
        B = P * N
        traj_seeds = np.repeat(np.asarray(seeds, dtype=np.int64), N)
        users = [[m] for m in self._reset(parts, traj_seeds)]
        group_prompts = [self.chat.prompt_ids(users[g * N][0]) for g in range(P)]
        ids = [list(group_prompts[b // N]) for b in range(B)]
        turn_limit, max_actions = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
        for part in parts:
            turn_limit[part.idx], max_actions[part.idx] = part.cfg.max_turns, part.cfg.max_actions_per_traj
        st = _Rollout(P, N, parts, traj_seeds, users, group_prompts, ids, turn_limit, max_actions)
        if self.window is not None:  # per token: its turn and the turn of the forward that fed it (window.py)
            heads = [ctxwin.head_length(self.chat, users[g * N][0], group_prompts[g]) for g in range(P)]
            st.window = {
                "heads": heads,
                "wturn": [[0] * heads[b // N] + [1] * (len(ids[b]) - heads[b // N]) for b in range(B)],
                "wfed": [[1] * len(x) for x in ids],
                "starts": [{1: heads[b // N]} for b in range(B)],  # turn -> index of its first token
                "special": set(self.tokenizer.all_special_ids),
            }
        for b in range(B):
            if len(ids[b]) + 1 > self.cfg.max_context:
                st.stop(b, STOP_CONTEXT)
        return st

    @staticmethod
    def _sampling_streams(P: int, N: int, seed: int, group_ids, device) -> tuple:
        """(the engine's generator: one torch.Generator, or one per session b by its group's
        id; the batch's group labels, int64 [P])."""
        if group_ids is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(seed))
            return gen, torch.arange(P)

        group_ids = [int(g) for g in group_ids]
        if len(group_ids) != P or len(set(group_ids)) != P or min(group_ids) < 0:
            raise ValueError(f"group_ids must be {P} distinct ints >= 0 (one per seed), got {group_ids!r:.200}")
        streams = [torch.Generator(device=device).manual_seed(group_sampling_seed(int(seed), g)) for g in group_ids]
        return {b: streams[b // N] for b in range(P * N)}, torch.tensor(group_ids, dtype=torch.long)

    def _turns(self, st: _Rollout, params: SamplingParams, gen) -> None:
        """Up to T turns: generate every live trajectory's response, step the env, append
        the next user message."""
        engine, K, N = self.engine, self.window, st.N
        active = [b for b in range(st.B) if not st.truncated[b]]
        if active:
            engine.start(st.group_prompts, N)
        append = None
        for turn in range(st.turns):
            if not active or (self.stop_check is not None and self.stop_check()):
                break
            j = turn + 1
            if K is not None and j > K:
                starts, heads = st.window["starts"], st.window["heads"]
                if self.refill_window:
                    append = list(append)
                    for i, b in enumerate(active):
                        engine.rewind(b, heads[b // N])
                        append[i] = st.ids[b][starts[b][j - K + 1]:]
                else:
                    for b in active:
                        engine.evict(b, starts[b][j - K], starts[b][j - K + 1])
            outs = engine.generate(active, append, params, gen)
            texts, emitted_eot, ended = self._record_responses(st, active, outs, turn, params)
            if all(t is None for t in texts):
                active = [b for b in active if b not in ended]
                continue
            res = self._score_turn(st, texts, turn)
            active, append = self._next_messages(st, active, ended, res, emitted_eot, turn)

    def _record_responses(self, st: _Rollout, active: list, outs: list, turn: int, params: SamplingParams) -> tuple:
        """Append each session's sampled ids (loss mask 1, with their log-probs, entropies and
        values) to its trajectory. Returns (B response texts, None where no turn happened;
        {b: the model emitted the template's end-of-turn token}; the sessions that ended)."""
        K, j = self.window, turn + 1
        texts = [None] * st.B
        emitted_eot = {}
        ended = set()
        for b, out in zip(active, outs):
            if not out.token_ids:  # no room for even one token: the turn did not happen
                st.stop(b, STOP_CONTEXT)
                ended.add(b)
                continue
            r = out.token_ids
            st.ids[b].extend(r)
            st.mask[b].extend([True] * len(r))
            st.lps[b].extend(float(x) for x in out.logprobs)
            for key, dest in (("entropies", st.ents), ("values", st.vals)):
                got = getattr(out, key, None) or []
                if len(got) == len(r):
                    dest[b].extend(float(x) for x in got)
                else:
                    st.recorded[key] = False
                    dest[b].extend([0.0] * len(r))
            st.tix[b].extend([turn] * len(r))
            if K is not None:
                st.window["wturn"][b].extend([j] * len(r))
                st.window["wfed"][b].extend([j] * (len(r) - 1) + [j + 1])  # the last token is fed next turn
            st.responses[b].append(torch.tensor(r, dtype=torch.long))
            st.turn_stops[b].append(out.stop_reason)
            texts[b], emitted_eot[b] = self._response_text(r, params.stop_strings)
            st.resp_texts[b].append(texts[b])
            st.num_turns[b] += 1
            if out.stop_reason == STOP_CONTEXT:
                st.stop(b, STOP_CONTEXT)
        return texts, emitted_eot, ended

    def _score_turn(self, st: _Rollout, texts: list, turn: int) -> EnvTurn:
        """Step the env(s) with this turn's responses (`env_turn`, each game under its own
        settings) and tally the results."""
        if len(st.parts) == 1:
            part = st.parts[0]
            res = env_turn(part.env, part.cfg, texts, st.actions_left, st.counters)
        else:
            res = merged_turn([(part.env, part.cfg, part.idx) for part in st.parts], texts, st.actions_left,
                              st.counters)
        st.turn_rewards[:, turn] += res.reward
        st.penalties[:, turn] += res.penalty
        st.valid_n += res.valid
        st.invalid_n += res.invalid
        st.effective_n += res.effective
        st.penalised_n += np.array([t is not None for t in texts]) & ~res.ok
        return res

    def _next_messages(self, st: _Rollout, active: list, ended: set, res: EnvTurn, emitted_eot: dict,
                       turn: int) -> tuple:
        """Give each trajectory that goes on its next user message's template ids (ending
        the others with their reason). Returns (the live sessions, their ids to append)."""
        cfg, K, j = self.cfg, self.window, turn + 1
        obs_now = {}
        new_active, new_append = [], []
        for b in active:
            if b in ended or st.truncated[b]:
                continue
            reason = end_reason(res, b, st.actions_left, turn, int(st.turn_limit[b]))
            if reason:
                st.stop_reason[b] = reason
                continue
            part = st.part(b)
            if int(st.part_of[b]) not in obs_now:  # rendered once per game and turn, only if some go on
                obs_now[int(st.part_of[b])] = part.env.render()
            msg = next_user_message(turn + 2, float(st.turn_rewards[b, turn]), obs_now[int(st.part_of[b])][st.pos[b]],
                                    int(st.actions_left[b]), cfg.think, cfg.max_new_tokens, note=res.notes[b],
                                    question=self._question(part.env, int(st.pos[b]), part.cfg))
            between = self.chat.between_turn_ids(msg, emitted_eot.get(b, False))
            if len(st.ids[b]) + len(between) + 1 > cfg.max_context:
                st.stop(b, STOP_CONTEXT)
                continue
            st.users[b].append(msg)
            if K is not None:
                w = st.window
                c = ctxwin.closing_length(between, w["special"], self.chat.eot_token_ids)
                w["starts"][b][j + 1] = len(st.ids[b]) + c
                w["wturn"][b].extend([j] * c + [j + 1] * (len(between) - c))
                w["wfed"][b].extend([j + 1] * len(between))
            st.extend_template(b, between)
            new_active.append(b)
            new_append.append(between)
        return new_active, new_append

    def _batch(self, st: _Rollout, labels, seconds: float) -> TrajectoryBatch:
        """The TrajectoryBatch of a finished rollout, with its metrics (see `generate`)."""
        K, N, P = self.window, st.N, st.P
        stats = self.engine.stats
        success = st.success
        scores = st.turn_rewards.sum(1)
        metrics = {
            "seconds": seconds,
            "engine_seconds": float(stats.get("seconds", 0.0)),
            "prefilled_tokens": float(stats["prefilled_tokens"]),
            "generated_tokens": float(stats["generated_tokens"]),
            "tokens_per_s": float(stats["generated_tokens"]) / max(seconds, 1e-9),
            "response_length": float(stats["generated_tokens"]) / max(1, st.counters.turns),
            "num_turns": float(st.num_turns.mean()),
            "success_rate": float(success.mean()),
            "score": float(scores.mean()),
            **st.counters.rates(),
            "truncated_rate": float(st.truncated.mean()),
            "num_actions": float((st.max_actions - st.actions_left).mean()),
            "peak_kv_bytes": float(stats.get("peak_kv_bytes", 0)),
            "peak_kv_token_bytes": float(stats.get("peak_kv_token_bytes", 0)),
        }
        window = {}
        if K is not None:
            window = {"context_turns": [torch.tensor(x, dtype=torch.long) for x in st.window["wturn"]],
                      "visible_from": [torch.tensor([f - K + 1 for f in x], dtype=torch.long)
                                       for x in st.window["wfed"]]}
        return TrajectoryBatch(
            input_ids=[torch.tensor(x, dtype=torch.long) for x in st.ids],
            loss_mask=[torch.tensor(x, dtype=torch.bool) for x in st.mask],
            sample_logprobs=[torch.tensor(x, dtype=torch.float32) for x in st.lps],
            sample_entropies=[torch.tensor(x, dtype=torch.float32) for x in st.ents] if st.recorded["entropies"] else [],
            sample_values=[torch.tensor(x, dtype=torch.float32) for x in st.vals] if st.recorded["values"] else [],
            turn_index=[torch.tensor(x, dtype=torch.long) for x in st.tix],
            turn_rewards=torch.from_numpy(st.turn_rewards), format_penalty=torch.from_numpy(st.penalties),
            num_turns=torch.from_numpy(st.num_turns), scores=torch.from_numpy(scores.astype(np.float32)),
            success=torch.from_numpy(success),
            num_actions=torch.from_numpy((st.max_actions - st.actions_left).astype(np.int64)),
            group_ids=labels.repeat_interleave(N), seeds=torch.from_numpy(st.seeds.copy()),
            truncated=torch.from_numpy(st.truncated), stop_reason=st.stop_reason, responses=st.responses,
            response_texts=st.resp_texts, metrics=metrics, user_messages=st.users, tokenizer=self.tokenizer,
            info={"env": self.env_name, "group_size": N, "num_groups": P,
                  **({"envs": [m.label for m, _ in self.members]} if self.mixed else {}),
                  **({"context_window": K, "refill_window": self.refill_window} if K is not None else {})},
            turn_stop_reasons=st.turn_stops, valid_actions=torch.from_numpy(st.valid_n),
            invalid_actions=torch.from_numpy(st.invalid_n), effective_actions=torch.from_numpy(st.effective_n),
            penalised_turns=torch.from_numpy(st.penalised_n),
            env_labels=[st.part(b).member.label for b in range(st.B)], final_observations=st.final_obs, **window,
        )


def _close(env) -> None:
    """Stop a plain-Python env's worker processes (the Numba games have none)."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _check_seeds(seeds) -> list:
    """`seeds` as a list of Python ints; ValueError naming `seeds` unless it is a non-empty
    sequence of non-negative integers (numpy integers and integer arrays accepted)."""
    if hasattr(seeds, "tolist"):  # numpy / torch arrays
        seeds = seeds.tolist()
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__iter__"):
        raise ValueError(f"seeds must be a non-empty list of non-negative integers, got {seeds!r:.100}")
    seeds = list(seeds)
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0]
    if not seeds or bad:
        raise ValueError(f"seeds must be a non-empty list of non-negative integers, got {seeds!r:.100}"
                         + (f" (bad: {bad[:3]!r})" if bad else ""))
    return [int(s) for s in seeds]
