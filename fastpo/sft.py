"""Supervised fine-tuning on expert trajectories: the RAGEN paper's SFT baseline
(arXiv 2504.20073, appendix: SFT on expert trajectories against StarPO-S).

    fastpo sft --env sokoban                      # -> runs/sft-sokoban (an HF model in its checkpoints)
    fastpo train --env sokoban --model runs/sft-sokoban

The expert data is a rollout: `expert_rollout` runs the ordinary `MultiTurnRollout` (the same
system prompt, game rules, chat template, answer format and between-turn observation tokens)
with an `ExpertEngine` in place of the sampling engine. Each turn the engine writes the
expert's answer as token ids (the tokenizer's ids of "Down || Right</answer>" after the
"<answer>" prime; in think mode "Expert plan: Down, Right.</think> <answer>Down || Right</answer>"
after "<think>"), and the rollout parses it, steps the env and appends the next observation
exactly as it does for a model's answer. So an SFT sequence is token for token what a rollout
whose model sampled those answers holds, with the loss mask on the answer tokens only.

The experts (envs_native): Sokoban's breadth-first `solve` (a shortest solution from the
current state), Bandit's `better_action` (the arm of higher expected reward) and FrozenLake's
`optimal_policy` (finite-horizon value iteration: the best action per cell and number of
actions left); a user game's own `expert()` (fastpo.envs.interface), asked each turn in the
state the previous answers reached. FrozenLake is stochastic: the expert acts closed loop,
choosing each action at the cell it actually reached (its own copy of the env draws the same
slips as the rollout's: both are seeded by the env seed). With `sft.actions_per_turn` = 1
(FrozenLake's default) every cell it acts on is shown to the model, so the model can imitate
it exactly; with more actions per turn the later actions of a turn depend on slips the model
never sees.

Training (`SFTTrainer`, on the StarPO trainer's parts and run loop; an iteration is one
optimizer step through `PolicyUpdater.step`):
token-in-token-out, the mean negative log-likelihood over the answer tokens of a mini-batch
of `sft.batch_size` expert trajectories (token-mean, as TRL's SFTTrainer), packed into the
trainer's padding-free micro-batches, AdamW at optim.actor_lr with optim.grad_clip. The run
folder, checkpoints (exact resume), metrics, plots, Ctrl-C / SIGTERM safety and the
before/after evaluation with the random and optimal lines are the trainer's; the expert's
own success on the eval seeds is logged beside them (`eval/expert_success`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Optional

import numpy as np
import torch

from fastpo.config.schema import TrainConfig, at_least
from fastpo.config.fields import ConfigError, checked
from fastpo.run.folder import SFT_FILE
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.loop import RunTrainer
from fastpo.trainer.models import hidden_states
from fastpo.trainer.plan import SUPERVISED
from fastpo.trainer.setup import check_prompts_fit, open_run
from fastpo.trainer.update import MetricMeans

# sft.common_prefix: the shortest shared lead worth a segment of its own (a chat header alone is
# about 10 tokens; the instructions of a built-in game 300-400)
MIN_COMMON_PREFIX = 16
_SALT_SFT_ORDER = 5_000_011  # (seed, epoch, salt) -> the order of the expert trajectories in that epoch

# What `fastpo sft` sets over the presets, before your overrides (which win): the run's length
# and checkpoints, one evaluation before and one after training, lr for SFT (1e-4: at 1e-5 a
# small budget hardly moves the model; docs/sft.md, "The default learning rate").
SFT_DEFAULT_OVERRIDES = ["trainer.iterations=32", "trainer.eval_every=1000000", "trainer.save_every=16",
                         "optim.actor_lr=1e-4", "trainer.eval_before_training=true"]


def sft_default_overrides(presets: list[str]) -> list[str]:
    """SFT_DEFAULT_OVERRIDES for a run on `presets` (their names): the `tiny` preset, a smoke run
    in every command, keeps its own run length and checkpoints (trainer.iterations, eval_every,
    save_every: 2 steps) instead of SFT's 32."""
    from fastpo.config.presets import PRESETS

    if "tiny" not in presets:
        return list(SFT_DEFAULT_OVERRIDES)
    kept = {f"trainer.{k}" for k in PRESETS["tiny"]["trainer"]}
    return [o for o in SFT_DEFAULT_OVERRIDES if o.split("=", 1)[0] not in kept]
#: What `fastpo sft --env GAME` adds on the CPU preset alone (this machine's default; `--preset paper`
#: keeps the paper's turns and answers), before your overrides: the best measured setting
#: (docs/sft.md, "1,536 levels"): one move per answer, closed loop, 10 turns of it, the prompt
#: saying one action per turn, 1,536 expert levels for one epoch (192 steps of 8), lr 2e-4.
#: (config overrides, sft.* overrides)
SFT_CPU_GAME_DEFAULTS = {
    "sokoban": (["rollout.max_turns=10", "rollout.max_actions_per_traj=10", "rollout.max_actions_per_turn=1",
                 "optim.actor_lr=2e-4", "trainer.iterations=192"],
                ["sft.actions_per_turn=1", "sft.trajectories=1536"]),
}


@dataclasses.dataclass
class SFTConfig:
    """The `sft.*` settings of `fastpo sft` (kept in the run folder's sft.yaml).

    trajectories: expert trajectories in the data set, one per env seed seed_offset,
    seed_offset + 1, ... (disjoint from the eval seeds: checked). batch_size: trajectories
    per optimizer step (one trainer iteration). common_prefix: pack a micro-batch's
    trajectories after one copy of the leading tokens they share (at least 16: the chat
    header, system prompt and instructions), computed once per micro-batch (with
    optim.share_prefix and "segments" attention; the same gradients up to float rounding).
    actions_per_turn: the expert's actions per
    turn (capped by rollout.max_actions_per_turn and the actions left); 0 = 1 on FrozenLake
    (closed loop: every cell acted on is observed), rollout.max_actions_per_turn otherwise.
    data: a JSONL file of conversations (`{"messages": [{"role": ..., "content": ...}, ...]}`
    per line, TRL's conversational format) to train on instead of the expert's trajectories
    ("" = the expert); then trajectories, seed_offset and actions_per_turn are not used.
    Kept as an absolute path, with the file's SHA-256 (data_sha256, set by the run): a resume
    refuses a file that changed.
    """

    data: str = checked("", lambda v: isinstance(v, str), "must be a path to a JSONL file of chat messages")
    data_sha256: str = checked("", lambda v: isinstance(v, str), "must be text (set by the run)")
    trajectories: int = checked(128, at_least(1), "must be >= 1")
    batch_size: int = checked(8, at_least(1), "must be >= 1")
    seed_offset: int = checked(0, lambda v: 0 <= v < 2**31, "must be in [0, 2**31)")
    actions_per_turn: int = checked(0, at_least(0), "must be >= 0 (0 = the env's default)")
    common_prefix: bool = checked(True, lambda v: isinstance(v, bool), "must be true or false")

    def seeds(self) -> list[int]:
        return list(range(self.seed_offset, self.seed_offset + self.trajectories))


def sft_config(overrides: list[str], base: Optional[SFTConfig] = None) -> SFTConfig:
    """An SFTConfig from `base` (default: the defaults) and dotted overrides "sft.key=value".
    Raises ConfigError naming a bad key or value."""
    from fastpo.config.fields import apply_dict, check_fields, parse_override

    cfg = dataclasses.replace(base) if base is not None else SFTConfig()
    for o in overrides:
        d = parse_override(o)
        apply_dict(cfg, d.get("sft", {}), prefix="sft.")
    check_fields(cfg, "sft.")
    if not cfg.data:
        check_batch_size(cfg.batch_size, cfg.trajectories, "expert trajectories (sft.trajectories)")
    return cfg


def check_batch_size(batch_size: int, n: int, what: str) -> None:
    """ConfigError when a step would take more than the whole data set (every step would
    repeat the same data, and an epoch would no longer be `n` trajectories)."""
    if batch_size > n:
        raise ConfigError(f"config key 'sft.batch_size' = {batch_size}: more than the {n} {what}; "
                          f"choose at most {n}")


def check_disjoint(sft: SFTConfig, cfg: TrainConfig) -> None:
    """ConfigError when the expert seeds overlap the eval seeds."""
    lo, hi = cfg.trainer.eval_seed_offset, cfg.trainer.eval_seed_offset + cfg.trainer.eval_seeds
    if sft.seed_offset < hi and lo < sft.seed_offset + sft.trajectories:
        raise ConfigError(f"config key 'sft.seed_offset' = {sft.seed_offset}: the expert seeds "
                          f"[{sft.seed_offset}, {sft.seed_offset + sft.trajectories}) overlap the eval seeds "
                          f"[{lo}, {hi}); choose expert seeds outside them")


def read_sft_config(out_dir: str) -> SFTConfig:
    """The SFTConfig of the run in `out_dir` (its sft.yaml). Raises ConfigError when missing or bad."""
    from fastpo.config.files import parse_config_yaml

    path = os.path.join(out_dir, SFT_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} not found: is {out_dir} a `fastpo sft` run folder?")
    with open(path, encoding="utf-8") as f:
        d = parse_config_yaml(f, path)
    return sft_config([f"sft.{k}={v}" for k, v in d.items()])


# ----------------------------------------------------------------------------------------- a data file

_ROLES = ("system", "user", "assistant")
_CONTENT_MARK = "\ue000fastpo:content\ue000"  # private-use characters: in no template or data


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (hex); ConfigError naming `sft.data` when it cannot be read."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise ConfigError(f"config key 'sft.data' = {path!r}: cannot be read ({e.strerror})") from None
    return h.hexdigest()


def chat_ids_and_mask(tokenizer, messages: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One conversation as the model's chat template renders it: (input_ids int64 [T],
    loss_mask bool [T]), the mask True on each assistant message's tokens and the end-of-turn
    marker the template closes it with (what a model samples), False elsewhere and on an
    assistant message with "weight": 0 (OpenAI's fine-tuning format: context, not a target).

    The assistant spans come from rendering each prefix of the conversation: the one through
    the message ends where its end-of-turn marker ends, and the message's text starts where a
    marker put in its place appears (a template may add text before the first message, such as
    a default system prompt); characters map to tokens through the tokenizer's offsets.
    Raises ValueError when the template fails, or renders a prefix otherwise than as the start
    of the whole (the conversation cannot be split into turns).
    """
    def render(msgs):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template's own refusal ("system role not supported", ...)
            raise ValueError(f"the model's chat template refused it: {type(e).__name__}: {e}") from None

    plain = [{"role": m["role"], "content": m["content"]} for m in messages]  # the template sees no weight
    text = render(plain)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        through = render(plain[:i + 1]).rstrip()
        # where the message's text starts: the same conversation with a marker in its place
        marked = render(plain[:i] + [{"role": "assistant", "content": _CONTENT_MARK}])
        start = marked.find(_CONTENT_MARK)
        if not text.startswith(through) or start < 0 or marked[:start] != through[:start]:
            raise ValueError("the model's chat template does not render a conversation's beginning as the start "
                             "of the whole; its assistant turns cannot be found")
        spans.append((start, len(through)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    mask = torch.tensor([any(a <= lo < z for a, z in spans) for lo, _ in enc["offset_mapping"]], dtype=torch.bool)
    return ids, mask


def longest_token(tokenizer) -> int:
    """The most characters of text one token of `tokenizer` stands for, bounded from above by
    the longest string in its vocabulary (a byte-level BPE token string holds one character per
    byte; special tokens count as written). A text of n characters takes at least n / it tokens."""
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


def read_chat_file(path: str, tokenizer, max_context: int) -> tuple[list, list]:
    """The conversations of a JSONL file, tokenized: (input_ids, loss_mask), one per line.

    Each non-blank line is one JSON object with "messages": a list of {"role": "system" |
    "user" | "assistant", "content": str} holding at least one assistant message (TRL's
    conversational format; other keys are ignored), an assistant message optionally with
    "weight": 0 or 1 (OpenAI's fine-tuning format; 0: in the context, not trained on). Raises
    ConfigError naming the file, the line number and what is wrong (not UTF-8, not JSON, no
    messages list, a bad role, content or weight, content that is not text (a lone
    surrogate), no assistant message of weight 1, more tokens than max_context: refused before
    tokenizing when its text alone is too long for them, `longest_token`), or a file with no
    conversation.
    """
    ids, masks = [], []
    longest = longest_token(tokenizer)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ConfigError(f"config key 'sft.data' = {path!r}: cannot be read ({e.strerror})") from None
    with f:
        for n, raw in enumerate(f, 1):
            where = f"{path}, line {n}"
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
            msgs = rec.get("messages") if isinstance(rec, dict) else None
            if not isinstance(msgs, list) or not msgs:
                raise ConfigError(f"{where}: needs a non-empty \"messages\" list of {{\"role\", \"content\"}} objects")
            for k, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                    raise ConfigError(f"{where}: message {k} must be {{\"role\": one of {list(_ROLES)}, \"content\": "
                                      f"text}}, got {json.dumps(m)[:80]}")
                if "weight" in m and (m["role"] != "assistant" or m["weight"] not in (0, 1)
                                      or isinstance(m["weight"], bool)):
                    raise ConfigError(f"{where}: message {k} has \"weight\": {json.dumps(m['weight'])[:40]}; only an "
                                      f"assistant message takes one, 0 or 1")
            if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in msgs):
                raise ConfigError(f"{where}: has no assistant message of weight 1 (nothing to train on)")
            for k, m in enumerate(msgs):  # valid JSON may hold a lone surrogate ("\ud800"): no tokenizer reads it
                try:
                    m["content"].encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ConfigError(f"{where}: message {k}'s content is not text: a lone surrogate "
                                      f"{m['content'][e.start]!r} at character {e.start + 1} (a JSON \\uD800-"
                                      f"\\uDFFF escape must be half of a pair)") from None
            # no conversation of more text than max_context tokens can hold is worth tokenizing
            # (a 10 MB line took minutes): its tokens are at least its text / the longest token
            text = sum(len(m["content"].strip()) for m in msgs)
            if text > max_context * longest:
                raise ConfigError(f"{where}: {text} characters of messages, more than rollout.max_context "
                                  f"({max_context}) tokens can hold (a token is at most {longest} characters)")
            try:
                x, m = chat_ids_and_mask(tokenizer, msgs)  # it renders role and content alone
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
            if len(x) > max_context:
                raise ConfigError(f"{where}: {len(x)} tokens, more than rollout.max_context ({max_context})")
            ids.append(x)
            masks.append(m)
    if not ids:
        raise ConfigError(f"config key 'sft.data' = {path!r}: holds no conversation")
    return ids, masks


# ----------------------------------------------------------------------------------------- experts

class _Expert:
    """The expert's next action per instance of a freshly reset env `env` (the shadow copy)."""

    def __init__(self, env, env_name: str, horizon: int):
        self.env, self.name = env, env_name
        self.plans: dict = {}
        if env_name == "frozenlake":
            self.policy = env.optimal_policy(horizon)
            self.horizon = horizon
        elif env_name == "bandit":
            self.better = env.better_action()

    def action(self, b: int, actions_left: int) -> int:
        """Action id of instance b's next expert move with `actions_left` actions left."""
        if self.name == "frozenlake":
            k = min(int(actions_left), self.horizon)
            return int(self.policy[b, k, int(self.env.positions()[b])])
        if self.name == "bandit":
            return int(self.better[b])
        plan = self.plans.get(b)
        if not plan:  # a shortest solution from the current state (deterministic: followed to the end)
            plan = self.env.solve(b) or []
            self.plans[b] = plan
        if not plan:  # unsolvable (a generated level never is): any move
            return 0
        return self.env.action_names(b).index(plan.pop(0))


class ExpertEngine:
    """A rollout engine (NativeEngine's session interface) whose answers are the expert's.

    Built for one `MultiTurnRollout.generate(seeds, group_size=1)` call: it keeps its own
    copy of the env, reset from the same `seeds`, stepped with the actions it answers, so
    its state is the rollout's. Per turn and session it returns the answer's token ids
    (`TurnOutput`, log-probs 0, stop reason "stop_string" when rollout.stop_at_answer_close,
    else the template's end-of-turn id is appended and the reason is "eot"). A built-in
    solver's answer that would pass rollout.max_new_tokens keeps fewer actions (ConfigError
    when not even one fits); a user game's `expert()` answer is played as written (the
    longest one past the cap is kept in `too_long`: (tokens, seed, answer), for
    `expert_rollout` to refuse); one that would pass rollout.max_context ends the session
    ("context", no tokens), as a sampling engine would.
    """

    device = torch.device("cpu")

    def __init__(self, rollout, seeds: list[int], actions_per_turn: int = 0):
        from fastpo.envs import make_env, resolve_env

        self.ro, self.cfg, self.tok, self.chat = rollout, rollout.cfg, rollout.tokenizer, rollout.chat
        self.seeds = list(seeds)
        self.native = resolve_env(rollout.env_name).kind == "native"
        self.env = make_env(rollout.env_name, len(self.seeds), rollout.env_config)
        if not self.native and not self.env.has_expert():
            raise ConfigError(no_expert_message(rollout.env_name))
        per_turn = actions_per_turn or (1 if rollout.env_name == "frozenlake" else self.cfg.max_actions_per_turn)
        self.per_turn = min(per_turn, self.cfg.max_actions_per_turn)
        self.too_long: Optional[tuple] = None  # (tokens, seed, answer) of the longest answer past max_new_tokens
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"prefilled_tokens": 0, "generated_tokens": 0, "forward_passes": 0, "seconds": 0.0,
                      "peak_kv_bytes": 0, "peak_kv_token_bytes": 0}

    def start(self, prompts: list, group_size: int = 1) -> None:
        if group_size != 1 or len(prompts) != len(self.seeds):
            raise ValueError(f"ExpertEngine serves {len(self.seeds)} env groups of one trajectory, "
                             f"got {len(prompts)} x {group_size}")
        self.env.reset(np.asarray(self.seeds, dtype=np.int64))
        self.expert = _Expert(self.env, self.ro.env_name, self.cfg.max_actions_per_traj) if self.native else None
        self.left = np.full(len(self.seeds), self.cfg.max_actions_per_traj, dtype=np.int64)
        self.length = {b: len(p) for b, p in enumerate(prompts)}
        self.stats["prefilled_tokens"] += sum(self.length.values())

    def finish(self) -> None:
        self.length = {}

    def session_length(self, session: int) -> int:
        return self.length[session]

    def _text(self, names: list | str) -> str:
        return expert_answer_text(names, self.chat.think)

    def _ids(self, names: list | str) -> list:
        ids = self.tok(self._text(names), add_special_tokens=False)["input_ids"]
        if not self.cfg.stop_at_answer_close:  # the model ends its turn itself
            ids = ids + [self.chat.eot_token_ids[0]]
        return ids

    def _fit(self, params, b: int) -> int:
        """The most actions of instance b whose answer fits max_new_tokens (longest names)."""
        longest = max(self.env.action_names(b), key=lambda n: len(self._ids([n])))
        k = self.per_turn
        while k > 0 and len(self._ids([longest] * k)) > params.max_new_tokens:
            k -= 1
        if k == 0:
            need = len(self._ids([longest]))
            raise ConfigError(f"config key 'rollout.max_new_tokens' = {params.max_new_tokens}: the expert's answer "
                              f"with one action ({self._text([longest])!r}) takes {need} tokens; raise "
                              f"rollout.max_new_tokens to at least {need}")
        return k

    def generate(self, sessions: list, append: list | None, params, generator=None) -> list:
        from fastpo.rollout.engine import STOP_CONTEXT, STOP_EOT, STOP_STRING, TurnOutput

        t0 = time.perf_counter()
        append = append if append is not None else [[] for _ in sessions]
        answers = self._native_answers(sessions, params) if self.native else self._game_answers(sessions, params)
        outs = []
        for b, extra in zip(sessions, append):
            ids = self._ids(answers[b])
            if self.length[b] + len(extra) + len(ids) > params.max_context:
                outs.append(TurnOutput([], [], STOP_CONTEXT))
                continue
            self.length[b] += len(extra) + len(ids)
            self.stats["prefilled_tokens"] += len(extra)
            self.stats["generated_tokens"] += len(ids)
            outs.append(TurnOutput(ids, [0.0] * len(ids), STOP_STRING if self.cfg.stop_at_answer_close else STOP_EOT))
        self.stats["seconds"] += time.perf_counter() - t0
        return outs

    def _game_answers(self, sessions: list, params) -> dict:
        """A user game's expert answers (its `expert()`), played on the shadow copy as the
        rollout plays them: the free text once, or the first moves up to the turn's cap."""
        B = len(self.seeds)
        going = [b for b in sessions if not self.env.done[b] and self.left[b] > 0]
        texts = dict(zip(going, self.env.expert_answers(going)))
        for b, text in texts.items():  # the longest one past the cap is said once all are known
            n = len(self._ids(text))
            if n > params.max_new_tokens and (self.too_long is None or n > self.too_long[0]):
                self.too_long = (n, self.seeds[b], text)
        active = np.zeros(B, dtype=bool)
        active[going] = True
        if self.env.free_text:
            res = self.env.step_text([texts.get(b) for b in range(B)], active=active)
        else:
            parsed = self.env.parse_actions([texts.get(b, "") for b in range(B)], self.cfg.max_actions_per_turn)
            acts = parsed.actions.copy()
            for b in going:  # the moves past the trajectory's action budget are not played
                acts[b, int(self.left[b]):] = -1
            res = self.env.step(acts, active=active)
        for b in going:
            self.left[b] -= int(res.num_executed[b])
        return {b: texts.get(b, "") for b in sessions}

    def _native_answers(self, sessions: list, params) -> dict:
        """The built-in solvers' moves for each session, closed loop on the shadow copy."""
        B = len(self.seeds)
        budget = {b: min(self._fit(params, b), int(self.left[b])) for b in sessions}
        chosen: dict = {b: [] for b in sessions}
        going = [b for b in sessions if budget[b] > 0 and not self.env.done[b]]
        while going:  # closed loop: each action from the state the previous one reached
            acts = np.full((B, 1), -1, dtype=np.int64)
            for b in going:
                acts[b, 0] = self.expert.action(b, int(self.left[b]))
            active = np.zeros(B, dtype=bool)
            active[going] = True
            res = self.env.step(acts, active=active)
            for b in going:
                chosen[b].append(int(acts[b, 0]))
                self.left[b] -= int(res.num_executed[b])
            going = [b for b in going if len(chosen[b]) < budget[b] and not self.env.done[b] and self.left[b] > 0]
        return {b: [self.env.action_names(b)[a] for a in chosen[b]] for b in sessions}


def expert_answer_text(answer: list | str, think: bool) -> str:
    """The expert's answer as the model writes it after the rollout's prime ("<answer>", or
    "<think>" in think mode): from move names (`answer` a list: "Down || Right</answer>"), or a
    user game's expert answer text (a str, taken as the `<answer>` content). In think mode the
    reasoning is a fixed template naming the moves: "Expert plan: Down, Right.</think>
    <answer>Down || Right</answer>"."""
    acts, plan = (answer, answer) if isinstance(answer, str) else (" || ".join(answer), ", ".join(answer))
    if think:
        return f"Expert plan: {plan}.</think> <answer>{acts}</answer>"
    return f"{acts}</answer>"


def no_expert_message(env_name: str) -> str:
    """What a game without an expert lacks for `fastpo sft` (one line)."""
    return (f"environment {env_name!r} has no expert for SFT: give its class a method expert() that returns the "
            f"answer for the current state (docs/custom_environments.md), or train on conversations with "
            f"sft.data=FILE.jsonl")


def has_expert(env_name: str) -> bool:
    """Whether `env_name` has an expert: a built-in game always; a user game with a callable
    `expert` on its class."""
    from fastpo.envs import resolve_env

    spec = resolve_env(env_name)
    return spec.kind == "native" or callable(getattr(spec.factory, "expert", None))


def check_expert(env_name: str) -> None:
    """ConfigError (one line, before any model loads) when `env_name` has no expert."""
    if not has_expert(env_name):
        raise ConfigError(no_expert_message(env_name))


def expert_rollout(tokenizer, env_name: str, env_options: dict, rollout_cfg, seeds: list[int],
                   actions_per_turn: int = 0):
    """The expert's trajectories on `seeds` (one each), rendered by `MultiTurnRollout`.

    rollout_cfg: a RolloutConfig (the prompt, format, turn and action limits of the run).
    Returns a TrajectoryBatch (input_ids, loss_mask True on the answer tokens, rewards,
    success, ...). Raises ValueError for bad seeds, ConfigError (a ValueError) for a
    max_new_tokens too small for one action or for a user expert's longest answer (naming
    it, its seed and the value needed), EnvError for a user game or expert() that fails
    (naming the call and the seed) or answers what the game refuses, RuntimeError when a
    built-in expert's answer is not read back as well formed (a bug).
    """
    from fastpo.rollout import MultiTurnRollout

    ro = MultiTurnRollout(None, tokenizer, env_name, dict(env_options), rollout_cfg)
    ro.engine = ExpertEngine(ro, seeds, actions_per_turn)
    batch = ro.generate(list(seeds), 1)
    if ro.engine.too_long is not None:
        n, seed, text = ro.engine.too_long
        raise ConfigError(f"config key 'rollout.max_new_tokens' = {rollout_cfg.max_new_tokens}: the longest answer "
                          f"the expert() of {env_name!r} gives, {ro.engine._text(text)!r:.120} (seed {seed}), takes "
                          f"{n} tokens; raise rollout.max_new_tokens to at least {n} (the model must be able to "
                          f"write what it imitates)")
    bad = torch.nonzero(batch.penalised_turns).flatten().tolist()
    if bad:
        from fastpo.envs import EnvError

        said = f"for seeds {[seeds[i] for i in bad[:5]]}: {batch.response_texts[bad[0]]!r:.200}"
        if not ro.engine.native:  # the user's expert gave answers the game or the parser refuses
            raise EnvError(f"environment {env_name!r}: its expert() gave answers that are penalised as malformed or "
                           f"invalid (a name not in action_names, or info['valid'] False) {said}")
        raise RuntimeError(f"expert answers read back as malformed {said}")  # a bug of fastpo's
    return batch


@torch.no_grad()
def first_action_accuracy(model, batch, max_trajectories: int = 64) -> tuple[float, int]:
    """Imitation measured directly: the share of expert answer turns whose first token (in
    answer-only mode the first action's name, one token for the built-in games) is the model's
    most likely next token, teacher-forced on the expert's own trajectory.

    model: a causal LM (HF or peft); batch: the expert's TrajectoryBatch (`expert_rollout`),
    of states the model was not trained on (e.g. the eval seeds); its first `max_trajectories`
    trajectories are scored, one forward each, logits only at the scored positions.
    Returns (accuracy in [0, 1], number of answer turns scored); (nan, 0) when there are none.
    """
    was_training = model.training
    model.eval()
    hits = turns = 0
    try:
        for ids, mask in zip(batch.input_ids[:max_trajectories], batch.loss_mask[:max_trajectories]):
            m = mask.bool()
            starts = torch.nonzero(m[1:] & ~m[:-1]).flatten() + 1  # each answer's first token
            if starts.numel() == 0:
                continue
            dev = next(model.parameters()).device
            logits = model(input_ids=ids[None].to(dev), logits_to_keep=(starts - 1).to(dev)).logits[0]
            hits += int((logits.argmax(-1).cpu() == ids[starts]).sum())
            turns += int(starts.numel())
    finally:
        model.train(was_training)
    return (hits / turns if turns else float("nan")), turns


# ----------------------------------------------------------------------------------------- the data of a run

@dataclasses.dataclass
class SFTData:
    """An SFT run's data, read before any model loads (`load_sft_data`).

    batch: a TrainBatch of the trajectories or conversations (token 0 unscored: packed as the
    update packs it); expert: the expert's TrajectoryBatch (None for a data file); digest: the
    data file's SHA-256 ("" for the expert); tokenizer: what tokenized it; seconds: the time it
    took; source: what `describe` names ("the expert" or the file's path); env_name: the game;
    seeds: the expert's seed range (first, last), None for a file; max_context: the run's
    rollout.max_context."""

    batch: TrainBatch
    expert: Optional[object]
    digest: str
    tokenizer: object
    seconds: float
    source: str
    env_name: str = ""
    seeds: Optional[tuple] = None
    max_context: int = 0

    def describe(self) -> list[str]:
        """The console lines saying what was read."""
        ids, masks = self.batch.input_ids, self.batch.loss_mask
        n_ans = int(sum(int(m.sum()) for m in masks))
        tokens = sum(x.numel() for x in ids)
        if self.expert is None:
            return [f"[bold]data[/] {self.source}: {len(ids)} conversations, {tokens} tokens of which {n_ans} "
                    f"assistant tokens ({self.seconds:.1f} s)"]
        return [f"[bold]expert data[/] {len(ids)} trajectories of {self.env_name} (seeds {self.seeds[0]}.."
                f"{self.seeds[1]}): success {float(self.expert.success.float().mean()):.3f}, "
                f"{self.expert.metrics['num_turns']:.2f} turns, {tokens} tokens of which {n_ans} answer tokens "
                f"({self.seconds:.1f} s)"]

    def warning(self) -> Optional[str]:
        """A warning about the data (expert trajectories cut by rollout.max_context), or None."""
        cut = int(self.expert.truncated.sum()) if self.expert is not None else 0
        if not cut:
            return None
        # e.g. a longer observation format with 10 turns on the CPU preset's 1,536 tokens
        return (f"{cut} of {len(self.batch.input_ids)} expert trajectories reached rollout.max_context "
                f"({self.max_context} tokens) before the game ended: their later turns are not in the data, and "
                f"evaluations stop there too; raise rollout.max_context")


def check_chat_path(path: str) -> None:
    """ConfigError naming `sft.data` and `path` unless it is a regular file: no such file, a
    folder, or something else (a device or a pipe: the file is read twice, and again on
    resume)."""
    import stat

    key = f"config key 'sft.data' = {path!r}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{key}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{key}: is a folder; give the JSONL file of conversations in it")
    if not stat.S_ISREG(st.st_mode):
        kind = "a character device" if stat.S_ISCHR(st.st_mode) else "a pipe" if stat.S_ISFIFO(st.st_mode) else \
            "a socket" if stat.S_ISSOCK(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode) else "not a file"
        raise ConfigError(f"{key}: is {kind}, not a regular file (the file is read twice at the start and again on "
                          f"--resume); copy the conversations into a file")


def check_chat_file(path: str, digest: str = "") -> str:
    """The SHA-256 of data file `path` (`sft.data`), after `check_chat_path` and, when `digest`
    (the run's) is given, checking that the file is unchanged. Raises ConfigError naming the
    key and the path (also for an unreadable or changed file)."""
    check_chat_path(path)
    key = f"config key 'sft.data' = {path!r}"
    got = file_sha256(path)
    if digest and got != digest:
        raise ConfigError(f"{key}: the file changed since this run began (SHA-256 {got[:12]}..., was "
                          f"{digest[:12]}...); put the run's data back, or start a new run")
    return got


def load_sft_data(cfg: TrainConfig, sft: SFTConfig, tokenizer=None) -> SFTData:
    """The data of SFT run (`cfg`, `sft`) from what needs no model: the file, the tokenizer
    (`tokenizer`, else loaded for `cfg.model.name`) and the game: the conversations of
    `sft.data` (`read_chat_file`; its batch size checked against them) or the expert's
    trajectories (`expert_rollout` on `sft.seeds()`). So every problem of the data is found
    before the model loads.

    Raises ConfigError (a bad or changed file naming the line, a batch larger than the data,
    an expert answer too long for rollout.max_new_tokens), EnvError (the user's game or its
    expert() failing, naming the call and the seed), ModelLoadError (a model name whose
    tokenizer cannot load)."""
    from fastpo.models import load_model_checked

    t0 = time.perf_counter()
    tok = tokenizer if tokenizer is not None else load_model_checked(cfg.model.name, tokenizer_only=True)
    r = cfg.rollout
    if sft.data:
        digest = check_chat_file(sft.data, sft.data_sha256)
        ids, masks = read_chat_file(sft.data, tok, r.max_context)
        check_batch_size(sft.batch_size, len(ids), f"conversations of {sft.data}")
        for m in masks:
            m[0] = False  # token 0 has no predecessor
        batch = TrainBatch(ids, masks, [torch.zeros(len(x)) for x in ids], [0] * len(ids))
        return SFTData(batch, None, digest, tok, time.perf_counter() - t0, sft.data, cfg.env.name,
                       max_context=r.max_context)
    expert = expert_rollout(tok, cfg.env.name, cfg.env.options, r.rollout_config(), sft.seeds(), sft.actions_per_turn)
    return SFTData(TrainBatch.from_rollout(expert, 0), expert, "", tok, time.perf_counter() - t0, "the expert",
                   cfg.env.name, (sft.seed_offset, sft.seed_offset + sft.trajectories - 1), r.max_context)


# ----------------------------------------------------------------------------------------- training

def batch_indices(seed: int, iteration: int, batch_size: int, n: int) -> list[int]:
    """The expert trajectories (indices in [0, n)) of SFT step `iteration` (1-based): the
    trajectories in order of a per-epoch shuffle, `batch_size` at a time across epochs, a
    pure function of its arguments (so a resume continues the order); an index repeated
    across an epoch boundary is taken once."""
    out: list[int] = []
    perms: dict = {}
    for q in range((iteration - 1) * batch_size, iteration * batch_size):
        epoch = q // n
        if epoch not in perms:
            g = torch.Generator().manual_seed(int(np.random.default_rng([seed, epoch, _SALT_SFT_ORDER]).integers(2**62)))
            perms[epoch] = torch.randperm(n, generator=g).tolist()
        i = perms[epoch][q % n]
        if i not in out:
            out.append(i)
    return out


class SFTTrainer(RunTrainer):
    """Supervised fine-tuning on the trainer's parts (`fastpo.trainer.setup.open_run` with the
    supervised plan: no critic, reference model or filter) and its run loop (`RunLoop`: run
    folder, checkpoints, exact resume, signals, evaluation, metrics): iteration i is one AdamW
    step (`PolicyUpdater.step`) on the mean answer-token NLL of `batch_indices(seed, i,
    sft.batch_size, n)`'s trajectories.

    cfg: the TrainConfig (model, env, rollout format and limits, optim, trainer: run folder,
    evaluation, checkpoints; its algorithm section is not read). sft: SFTConfig. Other
    arguments: `fastpo.trainer.loop.RunTrainer`. Metrics per iteration: sft/loss (mean NLL per
    answer token, nats), sft/answer_entropy (mean entropy of the model's next-token
    distribution on the answer tokens, nats), sft/answer_tokens, sft/trajectories, sft/epoch,
    actor/grad_norm, actor/updates, actor/skipped_updates, perf/train_tokens_per_s (all
    tokens of the packed trajectories per second of the step), time/update_s;
    train/success_rate and train/score_mean are the expert trajectories' of the step.
    """

    # an SFT run resumed by `fastpo train` would continue as StarPO
    resume_command = "fastpo sft --resume"
    # (from a data file: no success or score)
    progress_fields = (("success", "train/success_rate", ".2f"), ("score", "train/score_mean", ".3f"),
                       ("loss", "sft/loss", ".3f"))

    def __init__(self, cfg: TrainConfig, sft: SFTConfig, data: Optional["SFTData"] = None, **kw):
        super().__init__(cfg, **kw)
        self.sft = sft
        self.prepared = data  # `load_sft_data`'s, when the caller read it before any model loaded
        self.data = self.batch = self.ids = self.masks = None
        self._expert_eval: Optional[dict] = None
        self._expert_on_eval = None

    def check_prompts_fit(self) -> Any:
        """As the StarPO trainer's, with the tokenizer the prepared data was read with."""
        return check_prompts_fit(self.cfg, self.prepared.tokenizer if self.prepared is not None else None)

    def setup(self) -> None:
        """The run opened on the supervised plan, then its data: the prepared `SFTData`, else
        `load_sft_data` now (the expert's trajectories or the conversations of `sft.data`), as
        one batch record."""
        open_run(self, SUPERVISED)
        if self.sft.common_prefix:
            self.parts.scorer.min_common_prefix = MIN_COMMON_PREFIX
        data = self.prepared
        if data is None:
            if self.sft.data:  # the file's digest first: a folder whose data failed to build is still an SFT run's
                self.sft.data_sha256 = check_chat_file(self.sft.data, self.sft.data_sha256)
            if self.dist.is_main:
                self._write_sft_file()
            data = load_sft_data(self.cfg, self.sft, self.tokenizer)
            for line in data.describe():
                self.console.print(line, soft_wrap=True)
            if data.warning():
                self.warn(data.warning())
        else:
            self.sft.data_sha256 = data.digest or self.sft.data_sha256
            if self.dist.is_main:
                self._write_sft_file()
        self.data = data.expert
        self.batch = data.batch
        self.ids, self.masks = self.batch.input_ids, self.batch.loss_mask

    def _write_sft_file(self) -> None:
        import yaml

        from fastpo.run.folder import atomic_write_text

        atomic_write_text(os.path.join(self.out, SFT_FILE), yaml.safe_dump(dataclasses.asdict(self.sft),
                                                                          sort_keys=False))

    def expert_eval(self) -> dict:
        """{"eval/expert_success", "eval/expert_success_se"}: the expert's success on the eval
        seeds under this run's rollout settings (one trajectory per seed); its trajectories are
        kept for `first_action_accuracy`."""
        if self._expert_eval is None:
            from fastpo.config.schema import eval_seeds
            from fastpo.report.stats import standard_error

            b = expert_rollout(self.tokenizer, self.cfg.env.name, self.cfg.env.options,
                               self.cfg.rollout.rollout_config(), eval_seeds(self.cfg), self.sft.actions_per_turn)
            self._expert_on_eval = b
            s = b.success.double().numpy()
            self._expert_eval = {"eval/expert_success": float(s.mean()),
                                 "eval/expert_success_se": float(standard_error(s))}
        return self._expert_eval

    def evaluate(self, it: int) -> dict:
        """The policy's evaluation (`Sampler.evaluate`), with the expert's success on the same
        seeds and, in answer-only mode, the first-action accuracy (`first_action_accuracy`)."""
        res = super().evaluate(it)
        if not res or not has_expert(self.cfg.env.name):  # stopped (dropped), or a game without an expert
            return res
        res.update(self.expert_eval())
        if not self.cfg.rollout.think:  # in think mode an answer opens with reasoning, not an action
            acc, n = first_action_accuracy(self.model, self._expert_on_eval)
            res.update({"eval/first_action_accuracy": acc, "eval/first_action_turns": n})
        return res

    def iteration(self, it: int) -> dict:
        """One AdamW step on the mean answer-token NLL of this step's trajectories; its metrics."""
        t0 = time.perf_counter()
        idx = batch_indices(self.cfg.trainer.seed, it, self.sft.batch_size, len(self.ids))
        n_ans = sum(int(self.masks[i].sum()) for i in idx)
        updater = self.parts.updater
        acc = MetricMeans()
        self.stop.update_begins()
        self.model.train()
        stepped, tokens = updater.step(self.batch, idx, self._nll_loss(n_ans), acc)
        if not stepped:
            self.warn(f"iteration {it}: non-finite loss or gradient; SFT step skipped (weights unchanged)")
        updater.finish()  # gradients freed, eval mode, the step's memory back to the system
        dt = time.perf_counter() - t0
        nll, ent = acc.sums.pop("sft/nll", 0.0), acc.sums.pop("sft/entropy", 0.0)
        m = acc.means()  # the step's other means (the NLL and entropy sums are popped above)
        if self.data is not None:
            m.update({"train/success_rate": float(self.data.success[idx].float().mean()),
                      "train/score_mean": float(self.data.scores[idx].mean())})
        m.update({
            "sft/loss": nll / max(n_ans, 1), "sft/answer_entropy": ent / max(n_ans, 1), "sft/answer_tokens": n_ans,
            "sft/trajectories": len(idx), "sft/epoch": (it * self.sft.batch_size) / len(self.ids),
            "actor/updates": int(stepped), "actor/skipped_updates": int(not stepped),
            "perf/train_tokens_per_s": tokens / max(dt, 1e-9), "time/update_s": dt,
        })
        return m

    def _nll_loss(self, n_ans: int):
        """The `MicroLoss` of a step of `n_ans` answer tokens: their summed NLL / n_ans (the
        step's token mean once accumulated); logs the sums of NLL and entropy."""
        from fastpo.kernels import decoder_body, linear_logprob_entropy, lm_head_weight

        m = self.parts.models

        def loss(micro, scored):
            with m.autocast():
                h = hidden_states(decoder_body(m.policy), micro)
                lp, ent = linear_logprob_entropy(h[scored.rows], lm_head_weight(m.policy), scored.targets,
                                                 impl=self.cfg.trainer.kernel_impl)
                total = -lp.sum() / max(n_ans, 1)
            return total, {"sft/nll": float(-lp.detach().sum()), "sft/entropy": float(ent.detach().sum())}

        return loss

    def finish(self, records: list[dict]) -> None:
        """The imitation and expert lines of the last evaluation (labelled with its iteration), and
        the StarPO command that continues from this model once every step has run; a run
        stopped before its last step says how to resume instead (rank 0, after the report)."""
        ev = [r for r in records if "eval/success_rate" in r]
        if ev:
            for line in _result_lines(ev[-1]):
                self.console.print(line, markup=False)
        done = max((r.get("iteration", 0) for r in records), default=0)
        if done >= self.cfg.trainer.iterations:
            self.console.print("StarPO from this model: " + handoff_command(self.cfg), markup=False, soft_wrap=True)
        elif done >= 1:  # stopped: the model is not the one the run was asked for
            self.console.print(f"stopped after step {done} of {self.cfg.trainer.iterations}: finish it with "
                               f"`{self.resume_command} {self.out}`, then StarPO from the finished model: "
                               f"`{handoff_command(self.cfg)}`", markup=False, soft_wrap=True)


def _result_lines(last: dict) -> list[str]:
    """What an SFT run's last evaluation record `last` says of the imitation and the expert,
    labelled with its iteration ("before training" for iteration 0)."""
    it = int(last.get("iteration", 0))
    when = "before training (iteration 0)" if it == 0 else f"at iteration {it}"
    lines = []
    if "eval/first_action_accuracy" in last:
        lines.append(f"imitation {when}: the model's most likely first answer token is the expert's action in "
                     f"{last['eval/first_action_accuracy']:.3f} of {last['eval/first_action_turns']} expert "
                     f"turns on the eval seeds (teacher-forced)")
    if "eval/expert_success" in last:
        lines.append(f"expert (the solver, rendered as above) on the eval seeds: "
                     f"{last['eval/expert_success']:.3f} +- {last['eval/expert_success_se']:.3f}")
    return lines  # success against the random policy: the report's result line


def handoff_command(cfg: TrainConfig) -> str:
    """`fastpo train --env ENV --model OUT ...`: RL from an SFT run's model, with the game's
    options and the rollout settings that run used where `fastpo train --env ENV` (same preset)
    would use others: the model was trained on that rendering and format (`train --model`
    takes the weights, not the settings)."""
    import shlex

    from fastpo.config.schema import load_config

    import yaml

    def value(v) -> str:  # as the dotted overrides read it back (YAML): quoted text, flow lists
        if isinstance(v, str):
            return yaml.safe_dump(v, default_style='"', width=float("inf")).strip()
        return yaml.safe_dump(v, default_flow_style=True, width=float("inf")).removesuffix("\n...\n").strip()

    plain = load_config(env=cfg.env.name, preset=cfg.preset, check_env=False)
    over = [f"env.options.{k}={value(v)}" for k, v in sorted(cfg.env.options.items())
            if plain.env.options.get(k) != v]
    for f in dataclasses.fields(cfg.rollout):
        v = getattr(cfg.rollout, f.name)
        if v != getattr(plain.rollout, f.name):
            over.append(f"rollout.{f.name}={value(v)}")
    return " ".join(["fastpo train", "--env", shlex.quote(cfg.env.name), "--model",
                     shlex.quote(cfg.trainer.output_dir), *(shlex.quote(o) for o in over)])
