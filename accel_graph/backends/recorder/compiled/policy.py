"""Which program replays a recorder graph, and why: the one owner of the replay decision.

A recorder graph replays either its recorded program as captured (*interpreted*) or that
program compiled by Inductor (*compiled*). :class:`ReplayPolicy` decides which, from the
``compile=``/``compile_options=`` the front end resolved once
(:func:`~accel_graph.foundation.compile_options.resolve_compile`: ``CompileOptions | None``) and
from the facts the compiled-replay mechanism reports; every decision comes back as the
:class:`~accel_graph.backends.base.ReplayMode` that ``Graph.replay_mode()`` shows. The
mechanism lives elsewhere: compiling and falling back in :mod:`.choice`, the timing runs and the
analysis of what an extra run could change in :mod:`.replay_choice`.

The decision, in order (the first that applies):

1. ``compile=None``: interpreted; nothing is compiled.
2. ``compile_options={"replay": "interpreted"}``: interpreted; nothing is compiled.
3. Compilation failed: interpreted (the reason is in ``compile_info()["fallback"]``).
4. ``replay="compiled"``: compiled, untimed.
5. The graph runs collectives: compiled, untimed (ranks choosing differently would compute
   float-close, not equal, results).
6. ``replay="auto"``: the faster of the two, timed at instantiation when an extra run cannot be
   observed, else on the first real replays (``"undecided"`` until then).

At any point after 3, the compiled program failing at its first run switches the graph to
interpreted replay for good. Nothing here touches a program or a tensor: the methods map facts
to modes, so the decision reads in one place (docs/architecture.md, "Add a replay mode").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....foundation.compile_options import CompileOptions
from ...base import ReplayMode

__all__ = ["ReplayPolicy"]


@dataclass(frozen=True)
class ReplayPolicy:
    """The replay decision of one recorder graph, from its resolved ``compile`` value (None:
    no compiled replay; a :class:`CompileOptions`: ``compile="inductor"`` with those options)."""

    compile: CompileOptions | None

    @property
    def compiled_requested(self) -> bool:
        """Whether ``compile="inductor"`` was asked for: instantiation then runs the compiled
        decision (:meth:`skip_compile` onwards) instead of building the interpreted program."""
        return self.compile is not None

    @property
    def options(self) -> CompileOptions:
        """The compile options (the defaults when no compiled replay was asked for)."""
        return self.compile if self.compile is not None else CompileOptions()

    def not_instantiated(self, reset: bool = False) -> ReplayMode:
        """The mode of a graph not instantiated yet (``reset``: emptied by ``reset()``)."""
        if self.compile is None:
            return ReplayMode("interpreted", "compile=None: the recorded program replays as captured")
        if reset:
            return ReplayMode("undecided", "reset: nothing captured; the program is chosen when a "
                              "new capture is instantiated")
        return ReplayMode("undecided", "not instantiated yet: the program is chosen at instantiation")

    def skip_compile(self) -> tuple[ReplayMode, dict[str, Any]] | None:
        """Step 2: the interpreted mode and the ``compile_info()`` of a graph that compiles
        nothing, or None when the program is to be compiled."""
        if self.options.replay != "interpreted":
            return None
        return (ReplayMode("interpreted", "forced by compile_options={'replay': "
                           "'interpreted'} (nothing was compiled)"),
                {"backend": "inductor", "skipped": "compile_options replay='interpreted'"})

    def untimed(self, compile_failure: str | None, collectives: bool) -> ReplayMode | None:
        """Steps 3-5, once compilation was tried: the mode decided without timing, or None when
        the two programs are to be timed (``replay="auto"``). ``compile_failure`` is why
        compilation failed (None: it succeeded); ``collectives``: the graph runs collectives."""
        if compile_failure is not None:
            return ReplayMode("interpreted", f"compilation failed ({compile_failure})")
        if self.options.replay == "compiled":
            return ReplayMode("compiled", "forced by compile_options={'replay': 'compiled'}")
        if collectives:
            return ReplayMode(
                "compiled", "the graph runs collectives: every rank replays the compiled program, "
                "untimed (ranks choosing differently would compute float-close, not equal, results)")
        return None

    @staticmethod
    def observable_at_instantiation(hazard: str | None, shares_pool: bool) -> str | None:
        """Step 6: why timing at instantiation could be observed, or None when it cannot and
        both programs are timed there. ``hazard`` is what an extra run of the program could
        change (:func:`.replay_choice.instantiation_hazard`); ``shares_pool``: other graphs
        share the pool, or a capture into it is underway."""
        if hazard is None and shares_pool:
            hazard = "other graphs share its pool (an extra run could write memory they use)"
        return None if hazard is None else f"an extra run at instantiation could be observed: {hazard}"

    @staticmethod
    def timing_raised(exc: BaseException) -> str:
        """Why the decision moves to the real replays when a timing run raised (the real
        replay raises it again, to the caller)."""
        return f"a timing run at instantiation raised {type(exc).__name__}"

    @staticmethod
    def over_timing_budget(budget_s: float) -> str:
        """Why the decision moves to the real replays when the runs do not fit the budget."""
        return f"one run of each program takes over a share of the {budget_s:.2f} s timing budget"

    @staticmethod
    def timed(compiled_s: float, interpreted_s: float, rounds: int, where: str) -> ReplayMode:
        """The mode timing chose: compiled unless interpreted was faster (ties keep compiled).
        ``where`` is ``"at instantiation"`` or ``"on the first real replays"``."""
        mode = "compiled" if compiled_s <= interpreted_s else "interpreted"
        return ReplayMode(
            mode,
            f"{mode} replay measured faster: median {compiled_s * 1e3:.3f} ms compiled, "
            f"{interpreted_s * 1e3:.3f} ms interpreted ({rounds} interleaved run(s) each, {where})",
            compiled_s, interpreted_s, rounds,
            "instantiate" if where == "at instantiation" else "replay")

    @staticmethod
    def deciding(remaining: int, why: str) -> ReplayMode:
        """The mode while the first real replays time both programs (``remaining`` left)."""
        return ReplayMode("undecided", f"timing both programs on the first real replays "
                          f"({remaining} left): {why}")

    @staticmethod
    def first_run_failed(reason: str) -> ReplayMode:
        """The mode once the compiled program failed at its first run: interpreted for good."""
        return ReplayMode("interpreted", f"the compiled program failed at its first run ({reason})")
