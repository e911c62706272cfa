"""A reference-style (RAGEN-like) multi-turn rollout loop, the baseline of the benchmarks.

Every turn it re-renders each live trajectory's whole chat history as text with the chat
template, re-tokenizes it, left-pads the batch and calls ``model.generate``, which
re-prefills the whole history. Responses are decoded to strings, and the next turn's
prompt contains the decoded (rewritten) string, not the sampled ids. At the end the final
conversation text is tokenized once more to build the training sequence, as the reference
trains on re-tokenized text. The game logic (prompts, parsing, rewards, penalties, budget)
is fastpo's own, shared with `MultiTurnRollout`, so the two loops differ only in how they
handle tokens and KV caches.

It exists for side-by-side benchmarks (``bench/part_rollout.py``, the end-to-end
benchmark's ``bench/reference_iteration.py``), and lives with them, out of the package;
fastpo's trainer uses `MultiTurnRollout`. It is kept apart from that loop on
purpose, as a plain rendition of the reference's token handling (what the benchmarks measure
fastpo against), and shares the game logic rather than repeating it.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from fastpo.config.schema import RolloutConfig
import fastpo.envs_native as native_envs
from fastpo.rollout.trajectory_batch import TrajectoryBatch
from fastpo.rollout.turns import TurnCounters, closing_question, end_reason, env_turn
from fastpo.rollout.parsing import cut_at_stop
from fastpo.rollout.prompts import ChatFormat, first_user_message, next_user_message


class ReferenceRollout:
    """Re-render, re-tokenize, re-prefill every turn with ``model.generate``.

    Args: model, tokenizer, env_name, env_config, cfg as for MultiTurnRollout.
    ``generate`` returns a TrajectoryBatch built from the re-tokenized final conversations
    (sample_logprobs are zeros: the reference recomputes them in a separate forward) whose
    metrics have the same keys as MultiTurnRollout's.
    """

    def __init__(self, model, tokenizer, env_name: str, env_config: dict | None = None, cfg: RolloutConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.env_name = env_name
        self.env_config = dict(env_config or {})
        self.cfg = cfg if cfg is not None else RolloutConfig()
        self.chat = ChatFormat(tokenizer, think=self.cfg.think, system_prompt=self.cfg.system_prompt)

    def _render(self, messages: list, generation: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        return text + self.chat.prime if generation else text

    def generate(self, seeds, group_size: int, temperature: float | None = None, seed: int = 0) -> TrajectoryBatch:
        """Roll out len(seeds) groups x group_size trajectories the reference way (see module doc)."""
        cfg, tok, model = self.cfg, self.tokenizer, self.model
        t0 = time.perf_counter()
        seeds = [int(s) for s in seeds]
        P, N = len(seeds), int(group_size)
        B = P * N
        temp = cfg.temperature if temperature is None else temperature
        env = native_envs.make_native_env(self.env_name, B, **self.env_config)  # looked up now: bench swaps it
        traj_seeds = np.repeat(np.asarray(seeds, dtype=np.int64), N)
        obs = env.reset(traj_seeds)
        instr = env.instructions()

        def question(b: int) -> str:
            return closing_question(cfg, env.action_names(b))

        msgs = [self.chat.messages(first_user_message(instr[b], obs[b], cfg.max_actions_per_traj, cfg.max_actions_per_turn,
                                                      cfg.think, cfg.max_new_tokens, env.action_names(b),
                                                      question=question(b)))
                for b in range(B)]
        T = cfg.max_turns
        turn_rewards = np.zeros((B, T), dtype=np.float32)
        penalties = np.zeros((B, T), dtype=np.float32)
        num_turns = np.zeros(B, dtype=np.int64)
        actions_left = np.full(B, cfg.max_actions_per_traj, dtype=np.int64)
        truncated = np.zeros(B, dtype=bool)
        stop_reason = [""] * B
        resp_texts = [[] for _ in range(B)]
        counters = TurnCounters()
        prefilled = generated = 0
        eos = list(self.chat.eot_token_ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        active = list(range(B))
        try:
            for turn in range(T):
                if not active:
                    break
                active, enc, room = self._encode_histories(active, msgs, truncated, stop_reason)
                if not active:
                    break
                prefilled += int(enc["attention_mask"].sum())
                new = self._sample(enc, room, temp, int(seed) * 1000 + turn, eos, pad, device)
                texts = [None] * B
                for i, b in enumerate(active):
                    row = new[i].tolist()
                    # generated tokens: up to and including the first stop token
                    n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
                    generated += n
                    # the reference's rewritten response string
                    texts[b] = cut_at_stop(self.chat.prime + tok.decode(row[:n], skip_special_tokens=True),
                                           ("</answer>",) if cfg.stop_at_answer_close else ())
                    resp_texts[b].append(texts[b])
                    num_turns[b] += 1
                res = env_turn(env, cfg, texts, actions_left, counters)
                turn_rewards[:, turn] += res.reward
                penalties[:, turn] += res.penalty
                obs_now = env.render()
                nxt = []
                for b in active:
                    msgs[b].append({"role": "assistant", "content": texts[b]})
                    reason = end_reason(res, b, actions_left, turn, T)
                    if reason:
                        stop_reason[b] = reason
                        continue
                    msgs[b].append({"role": "user", "content": next_user_message(
                        turn + 2, float(turn_rewards[b, turn]), obs_now[b], int(actions_left[b]), cfg.think,
                        cfg.max_new_tokens, note=res.notes[b], question=question(b))})
                    nxt.append(b)
                active = nxt
        finally:
            model.train(was_training)
        for b in range(B):
            stop_reason[b] = stop_reason[b] or "max_turns"
        return self._batch(msgs, env, traj_seeds, P, N, turn_rewards, penalties, num_turns, actions_left, truncated,
                           stop_reason, resp_texts, counters, prefilled, generated, t0)

    def _encode_histories(self, active: list, msgs: list, truncated, stop_reason: list):
        """Render and tokenize the live trajectories' histories (left-padded). Those whose history
        leaves no room for one token end truncated ("context"). Returns (the trajectories still
        live, their encoding, the room left for new tokens)."""
        cfg, tok = self.cfg, self.tokenizer
        prompts = [self._render(msgs[b], True) for b in active]
        enc = tok(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        lens = enc["attention_mask"].sum(1)
        room = cfg.max_context - int(enc["input_ids"].shape[1])
        if room < 1:  # the longest history no longer fits: those trajectories end truncated
            keep = [i for i, n in enumerate(lens.tolist()) if n + 1 <= cfg.max_context]
            for i, b in enumerate(active):
                if i not in keep:
                    truncated[b], stop_reason[b] = True, "context"
            active = [active[i] for i in keep]
            if not active:
                return active, enc, room
            prompts = [prompts[i] for i in keep]
            enc = tok(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
            room = cfg.max_context - int(enc["input_ids"].shape[1])
        return active, enc, room

    def _sample(self, enc, room: int, temp: float, torch_seed: int, eos: list, pad: int, device):
        """`model.generate` over the encoded histories (the whole history prefilled again), with
        the global torch RNG seeded by `torch_seed`; returns the new token ids [rows, new] (CPU)."""
        cfg, tok = self.cfg, self.tokenizer
        gen_kw = dict(max_new_tokens=max(1, min(cfg.max_new_tokens, room)), eos_token_id=eos, pad_token_id=pad)
        if temp > 0:
            gen_kw.update(do_sample=True, temperature=float(temp), top_p=float(cfg.top_p), top_k=int(cfg.top_k))
        else:
            gen_kw.update(do_sample=False)
        if cfg.stop_at_answer_close:
            gen_kw.update(stop_strings=["</answer>"], tokenizer=tok)
        torch.manual_seed(torch_seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=enc["input_ids"].to(device),
                                      attention_mask=enc["attention_mask"].to(device), **gen_kw)
        return out[:, enc["input_ids"].shape[1]:].cpu()

    def _batch(self, msgs, env, traj_seeds, P, N, turn_rewards, penalties, num_turns, actions_left, truncated,
               stop_reason, resp_texts, counters, prefilled, generated, t0) -> TrajectoryBatch:
        """The TrajectoryBatch of the finished rollout, from the re-tokenized final conversations."""
        cfg, tok = self.cfg, self.tokenizer
        B = P * N
        ids, masks, tix = self._retokenize(msgs)
        seconds = time.perf_counter() - t0
        scores = turn_rewards.sum(1)
        metrics = {
            "seconds": seconds, "prefilled_tokens": float(prefilled), "generated_tokens": float(generated),
            "tokens_per_s": generated / max(seconds, 1e-9), "response_length": generated / max(1, counters.turns),
            "num_turns": float(num_turns.mean()), "success_rate": float(env.success.mean()), "score": float(scores.mean()),
            **counters.rates(), "truncated_rate": float(truncated.mean()),
            "num_actions": float((cfg.max_actions_per_traj - actions_left).mean()),
        }
        return TrajectoryBatch(
            input_ids=ids, loss_mask=masks, sample_logprobs=[torch.zeros(len(x)) for x in ids], turn_index=tix,
            turn_rewards=torch.from_numpy(turn_rewards), format_penalty=torch.from_numpy(penalties),
            num_turns=torch.from_numpy(num_turns), scores=torch.from_numpy(scores.astype(np.float32)),
            success=torch.from_numpy(env.success.copy()),
            num_actions=torch.from_numpy((cfg.max_actions_per_traj - actions_left).astype(np.int64)),
            group_ids=torch.arange(P).repeat_interleave(N), seeds=torch.from_numpy(traj_seeds.copy()),
            truncated=torch.from_numpy(truncated), stop_reason=stop_reason,
            responses=[[] for _ in range(B)], response_texts=resp_texts, metrics=metrics,
            user_messages=[[m["content"] for m in ms if m["role"] == "user"] for ms in msgs], tokenizer=tok,
            info={"env": self.env_name, "group_size": N, "num_groups": P, "loop": "reference"},
        )

    def _retokenize(self, msgs: list):
        """Tokenize each final conversation; loss mask on the assistant contents (by character span)."""
        tok = self.tokenizer
        ids, masks, tix = [], [], []
        for ms in msgs:
            text = self._render(ms, False)
            spans, pos = [], 0
            for m in ms:
                if m["role"] == "assistant":
                    start = text.find(m["content"], pos)
                    if start >= 0:
                        spans.append((start, start + len(m["content"])))
                        pos = start + len(m["content"])
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            x = torch.tensor(enc["input_ids"], dtype=torch.long)
            mk = torch.zeros(len(x), dtype=torch.bool)
            ti = torch.full((len(x),), -1, dtype=torch.long)
            for j, (a, b) in enumerate(enc["offset_mapping"]):
                for k, (s, e) in enumerate(spans):
                    if a >= s and b <= e and b > a:
                        mk[j] = True
                        ti[j] = k
                        break
            ids.append(x)
            masks.append(mk)
            tix.append(ti)
        return ids, masks, tix
