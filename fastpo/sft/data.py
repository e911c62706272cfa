"""The data of an SFT run, read before any model loads (`load_sft_data`): the expert's
trajectories (fastpo.sft.experts.expert_rollout) or the conversations of a JSONL file
(`read_chat_file`: TRL's conversational format, OpenAI's per-message "weight"), with every
check of the file (`check_chat_path`, `check_chat_file`: a regular file, unchanged since the
run began). Errors are one line naming `sft.data`, the file and the line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import time
from typing import Optional

import torch

from fastpo.config.fields import ConfigError
from fastpo.config.schema import TrainConfig
from fastpo.config.validation import check_batch_size
from fastpo.model_loading import load_model_checked
from fastpo.sft.experts import expert_rollout
from fastpo.trainer.batch import TrainBatch

_ROLES = ("system", "user", "assistant")
_CONTENT_MARK = "\ue000fastpo:content\ue000"  # private-use characters: in no template or data


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (hex); ConfigError naming `sft.data` when it cannot be read."""
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


def load_sft_data(cfg: TrainConfig, tokenizer=None) -> SFTData:
    """The data of SFT run `cfg` (a TrainConfig with an `sft` section) from what needs no model:
    the file, the tokenizer (`tokenizer`, else loaded for `cfg.model.name`; lazily: transformers
    is heavy) and the game: the conversations of `sft.data` (`read_chat_file`; its batch size
    checked against them) or the expert's trajectories (`expert_rollout` on `sft.seeds()`). So
    every problem of the data is found before the model loads.

    Raises ConfigError (a bad or changed file naming the line, a batch larger than the data,
    an expert answer too long for rollout.max_new_tokens), EnvError (the user's game or its
    expert() failing, naming the call and the seed), ModelLoadError (a model name whose
    tokenizer cannot load)."""
    t0 = time.perf_counter()
    sft = cfg.sft
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

