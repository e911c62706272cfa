"""Answer an upset customer: a free-text game whose reward comes from an LLM judge.

Train it (from the repository root, so that `examples` is importable):

    fastpo train --config examples/polite_reply.yaml

The game cannot tell a good reply from a bad one: it gives no reward of its own, and the judge
(`reward.judge_rubric_file`, examples/polite_rubric.txt) scores each reply yes / no for being
polite and addressing the problem (`reward.mode=replace`). `info["success"]` is a crude check
the game can make, that the reply apologises, logged beside the judge's score
(`train/judge_score_mean`) so the two can be compared.
"""
import random

COMPLAINTS = (
    "My order arrived two weeks late and the box was crushed.",
    "I was charged twice for the same subscription this month.",
    "The headphones you sold me stopped working after three days.",
    "Your support line kept me on hold for an hour and then hung up.",
    "The size chart was wrong, so the jacket does not fit.",
    "I returned the blender a month ago and still have no refund.",
    "The app logs me out every time I open it.",
    "You sent me the blue chair instead of the green one I ordered.",
)


class PoliteReply:
    """One customer message per seed; one free-text reply; no reward of the game's own."""

    action_names = None  # free text: the whole <answer> is the reply
    settings = {"max_turns": 1, "max_actions_per_turn": 1, "max_actions_per_traj": 1}
    instructions = ("You work in customer support. Reply to the customer's message in one or two sentences: be "
                    "polite and say what you will do about the problem.")

    def reset(self, seed: int) -> str:
        self.complaint = random.Random(seed).choice(COMPLAINTS)
        return f'Customer: "{self.complaint}"'

    def step(self, answer: str):
        apologises = any(w in answer.lower() for w in ("sorry", "apolog"))
        return "Thank you.", 0.0, True, {"success": apologises}
