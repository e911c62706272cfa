"""Prompt text and the token ids the chat template puts around model responses.

A trajectory is one chat (RAGEN's multi-turn prompt):

    system:    SYSTEM_PROMPT
    user:      env instructions + action limits + "Turn 1" + state + actions left + format reminder
    assistant: <think> ... </think> <answer> ... </answer>        (sampled tokens)
    user:      reward of the turn + "Turn 2" + state + actions left + format reminder
    assistant: ...

Rendering uses the tokenizer's own chat template. Model tokens are never rendered as text
again: `ChatFormat.between_turn_ids` derives the template text that follows an assistant
message by rendering a placeholder assistant message and cutting after it, so only the
template's own tokens (end-of-turn, separators, the next user message, the assistant
header and the generation prime) are tokenized.
"""
from __future__ import annotations

from typing import Sequence

SYSTEM_PROMPT = "You are a helpful assistant that plays text games. You think step by step, then act."
# answer-only mode (think=False) must not ask for reasoning it then cuts off
SYSTEM_PROMPT_NO_THINK = "You are a helpful assistant that plays text games. You answer with your actions directly."
THINK_PRIME = "<think>"
ANSWER_PRIME = "<answer>"
_PLACEHOLDER = "\u2063FASTPO_ASSISTANT_PLACEHOLDER\u2063"


def format_reminder(think: bool, max_new_tokens: int | None = None) -> str:
    """The per-turn format instruction (RAGEN's wording, shortened)."""
    fmt = "<think> [your thoughts] </think> <answer> [your answer] </answer>" if think else "<answer> [your answer] </answer>"
    text = f"Always output: {fmt} with no extra text. Strictly follow this format."
    if max_new_tokens:
        text += f" Max response length: {max_new_tokens} tokens."
    return text


def answer_example(action_names: Sequence[str], max_actions_per_turn: int) -> str:
    """The answer example of the first user message, built from the game's own action names.

    One action per turn: each of the first two actions as its own answer (RAGEN's Bandit
    prompt: "output like <answer> A </answer> or <answer> B </answer>"), so the example
    favours no action. Several: one answer with two actions joined by " || ".
    """
    names = [str(n) for n in action_names] or ["Up"]
    if max_actions_per_turn <= 1:
        return " or ".join(f"<answer> {n} </answer>" for n in names[:2])
    return f"<answer> {' || '.join(names[:2])} </answer>"


def move_question(action_names: Sequence[str], max_actions_per_turn: int) -> str:
    """The closing question of every user message in answer-only mode with
    `rollout.prompt_examples` (fastpo's, not RAGEN's wording): a question, then three answers
    in the exact format built from the game's own action names (one, two and three actions;
    one action each, joined by "or", when only one is allowed per turn).

    Why: a 135M model copies what follows "<answer>" elsewhere in its context. Under the
    "<answer> [your answer] </answer>" reminder, SmolLM2-135M-Instruct on FrozenLake
    (answer-only, temperature 0.5, 16 new tokens, 3 turns, 64 eval seeds) mostly echoed the
    user message ("You have 10 actions left. ..."): format-penalty rate 0.995. With every
    "<answer>" in the prompt followed by valid actions it mostly answers with actions
    (docs/results.md, how the CPU preset was chosen). Example: names (Left, Down, Right, Up), 5 per turn ->
    "Which way do you move? Answer with your moves, for example <answer>Down || Right</answer>
    or <answer>Up</answer> or <answer>Left || Left || Down</answer>."
    """
    n = [str(x) for x in action_names] or ["Up"]
    n = (n * 4)[:4]  # fewer than 4 names: repeat them
    if max_actions_per_turn <= 1:
        names = list(dict.fromkeys(n))
        return "Which one do you choose? Answer " + " or ".join(f"<answer>{x}</answer>" for x in names) + "."
    three = min(3, max_actions_per_turn)
    long = " || ".join([n[0], n[0], n[1]][:three])
    return (f"Which way do you move? Answer with your moves, for example <answer>{n[1]} || {n[2]}</answer> "
            f"or <answer>{n[3]}</answer> or <answer>{long}</answer>.")


def first_user_message(instructions: str, state: str, actions_left: int, max_actions_per_turn: int,
                       think: bool, max_new_tokens: int | None = None,
                       action_names: Sequence[str] = ("Up", "Left"), question: str = "",
                       free_text: bool = False) -> str:
    """Turn 1's user message: the game's rules, the action limits, the state, the format and
    an answer example.

    action_names: the instance's valid actions; the answer example is built from them (an
    example naming actions the game lacks, e.g. "Up" in Bandit, is copied by small models).
    The example comes last, right before the response. With it before the state (and the
    Bandit example naming one arm, under a "separated by ' || '" rule), SmolLM2-135M-Instruct
    answering Bandit in answer-only mode gave a well-formed answer in 2% of 128 samples at
    temperature 1.0 (4% at 0.7); with this message, 20% (61% at 0.7), same seeds.

    question: when not empty (`move_question`, answer-only mode with rollout.prompt_examples),
    it ends the message in place of the format reminder and the answer example.
    free_text: a game without named moves (fastpo.envs.interface): the whole answer is the
    turn's move, and no answer example is made up (the game's rules show its format).
    """
    if free_text:
        return (f"{instructions.rstrip()}\nYour whole answer is one move per turn.\n\n"
                f"Turn 1:\nState:\n{state}\n"
                f"You have {actions_left} actions left. {question or format_reminder(think, max_new_tokens)}")
    if max_actions_per_turn > 1:
        limit = f"You can take up to {max_actions_per_turn} action(s) per turn, separated by ' || '.\n"
    else:
        limit = "You take one action per turn.\n"
    if question:
        return f"{instructions.rstrip()}\n{limit}\nTurn 1:\nState:\n{state}\nYou have {actions_left} actions left. {question}"
    return (
        f"{instructions.rstrip()}\n{limit}\n"
        f"Turn 1:\nState:\n{state}\n"
        f"You have {actions_left} actions left. {format_reminder(think, max_new_tokens)} "
        f"For example: {answer_example(action_names, max_actions_per_turn)}"
    )


def next_user_message(turn: int, reward: float, state: str, actions_left: int, think: bool,
                      max_new_tokens: int | None = None, note: str = "", question: str = "") -> str:
    """The user message after a response: the turn's reward, then the next state and format.

    turn: the 1-based number of the coming turn. note: optional feedback (e.g. invalid actions).
    question: when not empty (`move_question`), it replaces the format reminder.
    """
    note = f"{note.strip()}\n" if note else ""
    return (
        f"Reward: {reward:g}\n{note}"
        f"Turn {turn}:\nState:\n{state}\n"
        f"You have {actions_left} actions left. {question or format_reminder(think, max_new_tokens)}"
    )


class ChatFormat:
    """Token ids of the non-model parts of a trajectory, from the tokenizer's chat template.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        think: prime each response with "<think>" (True) or "<answer>" (answer-only mode).
        system_prompt: the system message (None: SYSTEM_PROMPT, or SYSTEM_PROMPT_NO_THINK
            in answer-only mode).
    Raises ValueError when the tokenizer has no chat template.
    """

    def __init__(self, tokenizer, think: bool = True, system_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; fastpo needs an instruct model's tokenizer")
        self.tokenizer = tokenizer
        self.think = bool(think)
        default = SYSTEM_PROMPT if think else SYSTEM_PROMPT_NO_THINK
        self.system_prompt = default if system_prompt is None else system_prompt
        self.prime = THINK_PRIME if self.think else ANSWER_PRIME
        # The template text between an assistant message's content and the next user content.
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": _PLACEHOLDER}, {"role": "user", "content": _PLACEHOLDER}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        first = text.find(_PLACEHOLDER)
        second = text.find(_PLACEHOLDER, first + len(_PLACEHOLDER))
        if first < 0 or second < 0:
            raise ValueError("the chat template does not render message contents verbatim; unsupported template")
        self._after_assistant = text[first + len(_PLACEHOLDER):second]  # e.g. "<|im_end|>\n<|im_start|>user\n"
        self._after_user = text[second + len(_PLACEHOLDER):]  # e.g. "<|im_end|>\n<|im_start|>assistant\n"
        self.eot_token_ids = self._end_of_turn_ids()
        # The template's own end-of-turn token (first of eot_token_ids when the template has one).
        self.template_eot_id = self.eot_token_ids[0] if self._template_has_eot else None

    def _end_of_turn_ids(self) -> list:
        """Token ids that end an assistant turn: the template's end-of-turn token and the EOS."""
        tok = self.tokenizer
        ids = []
        lead = tok(self._after_assistant, add_special_tokens=False)["input_ids"]
        self._template_has_eot = bool(lead) and lead[0] in set(tok.all_special_ids)
        if self._template_has_eot:
            ids.append(lead[0])
        if tok.eos_token_id is not None and tok.eos_token_id not in ids:
            ids.append(tok.eos_token_id)
        return ids

    def messages(self, first_user: str) -> list:
        """The opening chat: [system, user]."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": first_user}]

    def prompt_ids(self, first_user: str) -> list:
        """Token ids of the opening chat with the assistant header and the prime, int list."""
        text = self.tokenizer.apply_chat_template(self.messages(first_user), tokenize=False, add_generation_prompt=True)
        return self.encode_template_text(text + self.prime)

    def encode_template_text(self, text: str) -> list:
        """Tokenize template-rendered text (special tokens in it are parsed; no BOS added
        unless the template itself wrote one)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def between_turn_text(self, user_message: str, model_emitted_eot: bool) -> str:
        """Template text after a response up to the next response: end-of-turn (unless the
        model emitted it), separators, the user message, the assistant header, the prime."""
        after = self._after_assistant
        if model_emitted_eot:
            eot = self.eot_text()
            if eot and after.startswith(eot):
                after = after[len(eot):]
        return after + user_message + self._after_user + self.prime

    def eot_text(self) -> str:
        """The template's end-of-turn string (e.g. "<|im_end|>"), "" if none."""
        if self.template_eot_id is None:
            return ""
        return self.tokenizer.convert_ids_to_tokens(self.template_eot_id)

    def between_turn_ids(self, user_message: str, model_emitted_eot: bool) -> list:
        """Token ids of `between_turn_text` (loss mask 0), int list."""
        return self.encode_template_text(self.between_turn_text(user_message, model_emitted_eot))
