"""Shorter polls in the SuperNode's main loop (Flower 1.41 and 1.42 have no setting for them).

After an empty pull from the SuperLink, Flower's SuperNode (1.41, 1.42) sleeps a fixed 3 s
(``time.sleep(3)`` in ``flwr.supernode.start_client_internal.start_client_internal``),
and while its ClientApp works it looks for the reply every 0.5 s
(``time.sleep(0.5)`` in ``_push_messages``); neither is read from an argument or an
environment variable. :func:`install`, called in the SuperNode's own process before its
main loop starts, gives that one module a ``time`` whose ``sleep`` shortens exactly
those two waits: the idle poll becomes ``poll`` s while the node has had a message in
the last ``idle_after`` s (so a node waiting between runs still asks only every 3 s),
and the reply wait becomes ``reply_poll`` s. A message's objects that are not on the
SuperLink yet when the SuperNode asks are asked for again after 0.02 s (doubling up to
0.5 s) instead of Flower's 1 s (``pull_objects``'s ``initial_backoff``, a parameter
Flower's loop leaves at its default). Nothing else in Flower changes.

This relies on Flower internals: the module's ``time`` and ``pull_objects`` globals, the
two literals, and ``_pull_and_store_message`` returning a run id when a message came. :func:`check`
reads the installed source and says what no longer matches; :func:`install` then leaves
Flower's polls as they are (slower, still correct), and ``tests/test_deploy_warm.py``
fails, so an upgrade of Flower cannot silently lose or break the patch.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
import types
from collections.abc import Callable
from typing import Any

MODULE = "flwr.supernode.start_client_internal"
IDLE_SLEEP = 3  # Flower 1.41, 1.42: `time.sleep(3)` after an empty pull
REPLY_SLEEP = 0.5  # Flower 1.41, 1.42: `time.sleep(0.5)` while the ClientApp's reply is pending
PULL = "_pull_and_store_message"
OBJECTS = "pull_objects"  # the SuperNode's pull of a message's objects from the SuperLink
OBJECT_BACKOFF = 0.02  # s before asking again for an object not there yet (Flower: 1 s)
OBJECT_BACKOFF_CAP = 0.5


def _module() -> types.ModuleType:
    import flwr.supernode.start_client_internal as sci

    return sci


def check() -> str | None:
    """Why the patch cannot apply to the installed Flower (None: it can)."""
    sci = _module()
    if getattr(sci, "time", None) is not time:
        return f"{MODULE} no longer uses the module `time` as a global"
    funcs = [getattr(sci, name, None) for name in ("start_client_internal", "_push_messages")]
    if not all(inspect.isfunction(f) for f in funcs):
        return f"{MODULE}.start_client_internal or _push_messages is gone"
    loop, push = (inspect.getsource(f) for f in funcs)  # type: ignore[arg-type]
    if f"time.sleep({IDLE_SLEEP})" not in loop or f"{PULL}(" not in loop:
        return f"{MODULE}.start_client_internal no longer calls time.sleep({IDLE_SLEEP}) " \
               f"after {PULL}"
    if f"time.sleep({REPLY_SLEEP})" not in push:
        return f"{MODULE}._push_messages no longer waits with time.sleep({REPLY_SLEEP})"
    if not callable(getattr(sci, PULL, None)):
        return f"{MODULE}.{PULL} is gone"
    objects = getattr(sci, OBJECTS, None)
    if not callable(objects) or f"{OBJECTS}(" not in loop + inspect.getsource(
            getattr(sci, PULL)) or not {"initial_backoff", "backoff_cap"} <= set(
            inspect.signature(objects).parameters):
        return f"{MODULE} no longer pulls message objects with {OBJECTS}(initial_backoff=)"
    return None


class PollClock(types.ModuleType):
    """``time`` for the SuperNode's loop: every name is the real one but ``sleep``."""

    def __init__(self, poll: float, reply_poll: float, idle_after: float) -> None:
        super().__init__("time")
        self.poll, self.reply_poll, self.idle_after = poll, reply_poll, idle_after
        self.last_message = time.monotonic()  # fast from the start: a run is coming

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def wait(self, seconds: float, now: float) -> float:
        """How long to sleep when Flower's loop asks for ``seconds`` at ``now``."""
        if seconds == IDLE_SLEEP and now - self.last_message < self.idle_after:
            return self.poll
        if seconds == REPLY_SLEEP:
            return min(seconds, self.reply_poll)
        return seconds

    def sleep(self, seconds: float) -> None:
        """Flower's two fixed waits, shortened; any other sleep as asked."""
        time.sleep(self.wait(seconds, time.monotonic()))

    def watch(self, pull: Callable[..., Any]) -> Callable[..., Any]:
        """``_pull_and_store_message``, noting when a message came (a run id back)."""
        def pull_and_note(*args: Any, **kwargs: Any) -> Any:
            run_id = pull(*args, **kwargs)
            if run_id is not None:
                self.last_message = time.monotonic()
            return run_id
        return pull_and_note


def install(poll: float = 0.1, reply_poll: float = 0.05,
            idle_after: float = math.inf) -> str | None:
    """Shorten the SuperNode's polls in this process; returns why not (None: done)."""
    why = check()
    if why is not None:
        return why
    sci = _module()
    clock = PollClock(poll, reply_poll, idle_after)
    setattr(sci, PULL, clock.watch(getattr(sci, PULL)))
    setattr(sci, OBJECTS, functools.partial(getattr(sci, OBJECTS), initial_backoff=OBJECT_BACKOFF,
                                            backoff_cap=OBJECT_BACKOFF_CAP))
    sci.time = clock  # type: ignore[attr-defined]
    return None
