"""The one error type of environment definitions and runs, and what counts as a user's code failing."""
from __future__ import annotations

import signal
from typing import Optional


class EnvError(ValueError):
    """A bad environment: unknown name, failing import, a class that does not implement the
    interface, an option it does not take, an exception inside its reset/step (naming the
    env and the instance's seed) or a wrong return type (naming the field). One line."""


def user_code_failure(e: BaseException) -> Optional[str]:
    """How a call into a user's code (a game's reset/step/expert, a reward function) failed, as
    the end of a one-line EnvError: "raised ValueError: <first line>" or "called sys.exit(4)";
    None for what must go on up unchanged.

    Every Exception is the code's own failure, and so is SystemExit (`sys.exit` inside a game or
    a reward function must not end the trainer silently: its process holds the user's run). A
    KeyboardInterrupt is the code's own when no signal can have raised it: its type is exactly
    KeyboardInterrupt while the SIGINT handler is not Python's default one (the `fastpo` command
    and the run loop install handlers whose Ctrl-C raises a subclass or nothing; a worker
    process ignores SIGINT). Under Python's default handler a Ctrl-C and the code's own raise
    look alike, so it goes on up as the interrupt it may be.
    """
    if isinstance(e, Exception):
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        return f"raised {type(e).__name__}: {lines[0][:300] if lines else '(no message)'}"
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    if type(e) is KeyboardInterrupt and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return "raised KeyboardInterrupt (not a Ctrl-C: no signal arrived)"
    return None
