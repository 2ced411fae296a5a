"""What a client hands the serving engine and what it gets back: requests, results, and the
errors a request can meet at the door (bad input, a full queue).

Kept apart from the engine so the scheduler, the metrics and the bench share the types without
importing the engine's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import AccelGraphError

__all__ = ["FINISH_REASONS", "InvalidRequest", "QueueFull", "Request", "RequestResult"]

#: Why a request ended: ``"length"`` (max_new_tokens generated), ``"eos"`` (the EOS token was
#: generated; it is the last token of the result), ``"rejected"`` (refused at submission: bad
#: input, see ``error``), ``"error"`` (a step holding it failed and no fallback could serve it).
FINISH_REASONS = ("length", "eos", "rejected", "error")


class InvalidRequest(AccelGraphError, ValueError):
    """A request the engine cannot serve (empty prompt, ``max_new_tokens < 1``, a prompt or a
    total length over the cache, a token id outside the vocabulary). Raised by
    ``Engine.submit`` for that request only: nothing queued or running is touched."""


class QueueFull(AccelGraphError):
    """The engine's bounded request queue is full (back-pressure). Nothing was queued: retry the
    same request after a step has run (``Engine.step``), or build the engine with a larger
    ``max_queue``. The queue never grows past its bound, so memory stays bounded."""


@dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        prompt: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to generate at most (at least one).
        eos_id: generation stops after this token is generated (None: only on length).
        arrival: when the request arrives, in seconds after the start of ``Engine.run`` (a
            simulated client); ``Engine.submit`` stamps its own time instead.
        id: the caller's name for the request (``Engine.run`` uses the index when None).
    """

    prompt: tuple[int, ...]
    max_new_tokens: int
    eos_id: int | None = None
    arrival: float = 0.0
    id: int | str | None = None

    def __post_init__(self) -> None:
        # Accept any sequence of ints (a list is the common case), store an immutable tuple.
        object.__setattr__(self, "prompt", tuple(self.prompt))


@dataclass
class RequestResult:
    """What became of one request. Times are seconds on the engine's clock.

    Attributes:
        id: the request's id.
        tokens: the generated tokens (without the prompt); for ``"eos"`` the last one is EOS.
        finish_reason: one of :data:`FINISH_REASONS`.
        prompt_len: the prompt's length.
        arrival: when the request arrived.
        token_times: when each generated token was known on the host (one time per token).
        error: the reason for ``"rejected"`` or ``"error"``; None otherwise.
    """

    id: int | str | None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_len: int = 0
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds from arrival), None when no token was generated."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (seconds), None with fewer than two."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def ok(self) -> bool:
        return self.finish_reason in ("length", "eos")
