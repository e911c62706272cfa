"""Guess the number with higher/lower feedback: a complete fastpo environment.

Train it (from the repository root, so that `examples` is importable):

    fastpo train --env examples.guess_number:GuessNumber env.options.high=16
    fastpo sft   --env examples.guess_number:GuessNumber env.options.high=16   # imitate its expert()

The agent answers a number in <answer>...</answer>; the game says "higher" or "lower".
Binary search always wins within ceil(log2(high - low + 2)) guesses, so the optimal line is
known exactly; so is the uniformly random guesser's.
"""
import math
import random


class GuessNumber:
    """A secret integer in [low, high]; reward 1 when guessed, 0 otherwise."""

    action_names = None  # free text: the whole answer is the guess
    settings = {"max_turns": 5, "max_actions_per_turn": 1, "max_actions_per_traj": 5}

    def __init__(self, low: int = 1, high: int = 16):
        if not (isinstance(low, int) and isinstance(high, int) and low < high):
            raise ValueError(f"need integers low < high, got low={low!r}, high={high!r}")
        self.low, self.high = low, high
        self.instructions = (f"I am thinking of a whole number from {low} to {high}. Guess it: answer one number. "
                             "After each guess I say whether my number is higher or lower.")

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.lo, self.hi = self.low, self.high  # what the hints so far leave possible
        return f"Guess a number from {self.low} to {self.high}."

    def step(self, answer: str):
        try:
            guess = int(answer.strip())
        except ValueError:
            return f"'{answer.strip()[:20]}' is not a whole number. Guess again.", 0.0, False, {"success": False, "valid": False}
        if guess == self.secret:
            return f"{guess} is right!", 1.0, True, {"success": True}
        hint = "higher" if guess < self.secret else "lower"
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
        else:
            self.hi = min(self.hi, guess - 1)
        return f"My number is {hint} than {guess}.", 0.0, False, {"success": False}

    def expert(self) -> str:
        """Binary search, for `fastpo sft`: the middle of what the hints so far leave possible."""
        return str((self.lo + self.hi) // 2)

    def optimal_success(self, seeds, horizon):
        """Binary search: wins within ceil(log2(n + 1)) guesses for any secret."""
        n = self.high - self.low + 1
        return [1.0 if horizon >= math.ceil(math.log2(n + 1)) else (2 ** horizon - 1) / n for _ in seeds]

    def random_success(self, seeds, horizon):
        """A uniformly random guess each turn, ignoring the hints: 1 - (1 - 1/n)^horizon."""
        n = self.high - self.low + 1
        return [1.0 - (1.0 - 1.0 / n) ** horizon for _ in seeds]
