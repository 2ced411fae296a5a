"""How a recorder graph with ``compile="inductor"`` picks its replay program (a mixin of
:class:`..backend.RecorderGraphImpl`, split from it to keep modules small).

At instantiation the captured program is compiled (:func:`.segmented.compile_any`); ops
Inductor refuses replay interpreted inside the compiled program (:mod:`.op_islands`; logged,
listed in ``compile_info()["interpreted_ops"]``); any other failure, or one that leaves nothing
compiled, falls back to the interpreted program with the reason logged and kept in
``compile_info()["fallback"]`` (issue 15). Which program then replays (compiled, interpreted,
or the faster of the two, timed by :mod:`.replay_choice`) is decided by the graph's
:class:`.policy.ReplayPolicy`; this module carries the decision out. The compiled program's
first run is checked (:mod:`.first_run`): a failure that shows only when the generated code
first runs (at the timing run, on the first real replay, or in the decider's first round) falls
back the same way.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

from ...base import ReplayMode
from ..program import build_replay
from . import replay_choice
from .failures import compiler_hint, failure_reason, quiet_torch_errors
from .first_run import FirstRun, undo_plan
from .freezing import written_storages
from .fx_graph import CompileUnsupported
from .inductor import compile_program
from .op_islands import describe as describe_islands
from .policy import ReplayPolicy
from .precision_casts import refusal as precision_refusal
from .random_order import refusal as order_refusal
from .segmented import compile_any

log = logging.getLogger("accel_graph")

__all__ = ["CompiledChoice"]


class CompiledChoice:
    """The compiled replay of a recorder graph: compile, fall back, time, follow the graph's
    :class:`.policy.ReplayPolicy` (``_policy``), which decides, and answer ``replay_mode()``.
    The host class provides the captured program (``_steps``, ``_frozen_steps``, ``_inputs``,
    ``_outputs``, ``_pool``, ``_signature``), ``device`` and the state set here
    (``_compiled``, ``_mode``, ``_decider``, ``_replay_fn``)."""

    _steps: list
    _frozen_steps: list
    _inputs: list
    _outputs: list
    _pool: Any
    _signature: Any
    _policy: ReplayPolicy
    device: Any
    _compiled: dict[str, Any] | None
    _mode: ReplayMode
    _decider: Any
    _replay_fn: Any

    def _choose_program(self) -> Any:
        """The program the policy picks: compiled, interpreted, the faster of the two measured
        now, or a decider timing both on the first real replays. Sets ``self._mode``."""
        policy = self._policy
        skipped = policy.skip_compile()
        if skipped is not None:
            self._mode, self._compiled = skipped
            return build_replay(self._steps, self._inputs)
        compiled = self._compiled_or_none()
        assert self._compiled is not None
        mode = policy.untimed(None if compiled is not None else self._compiled["fallback"],
                              collectives=self._signature is not None)
        if mode is not None:
            self._mode = mode
            return compiled if mode.mode == "compiled" else build_replay(self._steps, self._inputs)
        interpreted = build_replay(self._steps, self._inputs)
        assert self._pool is not None
        why = policy.observable_at_instantiation(
            replay_choice.instantiation_hazard(self._frozen_steps),
            shares_pool=self._pool.graphs != 1 or self._pool.capturing)
        if why is None:
            budget = replay_choice.timing_budget(float(self._compiled.get("compile_s", 0.0)))
            outputs = [self._pool.materialize(r) for r in self._outputs]
            try:
                timed = replay_choice.time_programs(compiled, interpreted, replay_choice.run_as_replay,
                                                     outputs, budget)
            except Exception as exc:  # the real replay will raise it again; decide there
                timed, why = None, policy.timing_raised(exc)
            if "fallback" in self._compiled:  # the compiled program failed at its first run
                return self._replay_fn
            if timed is not None:
                self._mode = policy.timed(*timed, "at instantiation")
                return compiled if self._mode.mode == "compiled" else interpreted
            why = why or policy.over_timing_budget(budget)
        decider = replay_choice.ReplayDecider(self, compiled, interpreted, why)
        self._decider = decider
        return decider

    def replay_mode(self) -> ReplayMode:
        """Which program replays and why (``Graph.replay_mode()``)."""
        decider = self._decider
        if decider is not None:
            return self._policy.deciding(decider.remaining, decider.why)
        return self._mode

    def settle_replay(self, decider: Any, compiled_s: float, interpreted_s: float,
                      rounds: int) -> None:
        """Called by the :class:`.replay_choice.ReplayDecider` of this graph once it timed both
        programs: the policy's verdict replays from now on (the decider of an earlier capture
        changes nothing)."""
        if decider is not self._decider:
            return
        self._decider = None
        self._mode = self._policy.timed(compiled_s, interpreted_s, rounds, "on the first real replays")
        if self._replay_fn is decider:
            self._replay_fn = decider.program(self._mode.mode)

    def _compiled_or_none(self) -> Any:
        """The compiled replay function, or None with the reason logged and kept in
        ``self._compiled["fallback"]`` (the interpreted program then replays)."""
        assert self._pool is not None
        try:
            # A torch whose Inductor CPU code cannot keep eager's fp16/bf16 rounding, or the
            # order of random draws: refused here, replayed interpreted (never a silently
            # different result).
            why = (precision_refusal(self._frozen_steps, self.device.device_type)
                   or order_refusal(self._frozen_steps))
            if why:
                raise CompileUnsupported(why)
            with quiet_torch_errors():  # our one log line below says what failed
                run, info = compile_any(self._frozen_steps, self._inputs, self._outputs,
                                        self._pool, self._compile_fn())
        except Exception as exc:  # any compiler failure: replay still works, interpreted
            reason = failure_reason(exc)
            hint = compiler_hint(exc)
            log.warning("compile='inductor' failed for a graph on %s (%s); using interpreted "
                        "replay.%s", self.device, reason, hint)
            self._compiled = {"backend": "inductor", "fallback": reason}
            return None
        self._compiled = info
        if info.get("interpreted_ops"):
            # Not a fallback of the graph, but the same prefix: the test plug-in's compiled
            # cases must not pass silently with an op interpreted (accel_graph.testing.plugin).
            log.warning("compile='inductor' failed for some ops of a graph on %s (%s); they "
                        "replay interpreted inside the compiled program, the rest is compiled.",
                        self.device, describe_islands(info["interpreted_ops"]))
        checks = build_replay([], self._inputs)  # the stale-input checks alone
        # Failures that show only when the generated code first runs fall back too.
        plan = undo_plan(self._frozen_steps, self.device.device_type, self.device.index) if self._signature is None else None
        graph = weakref.ref(self)  # held weakly: the graph stays freed by reference counting

        def failed(exc: BaseException, undone: bool) -> Any:
            me = graph()
            if me is None:  # cannot happen while the graph replays; never swallow the error
                raise exc
            return me._first_run_failed(exc, undone)

        first = FirstRun(run, plan, self._pool, failed)

        def replay() -> None:
            checks()  # a stale input is the caller's error, raised before the guarded run
            first.fn()

        return replay

    def _first_run_failed(self, exc: BaseException, undone: bool) -> Any:
        """The compiled program raised at its first run (:mod:`.first_run`): log the
        reason, keep it in ``compile_info()`` and replay interpreted from now on."""
        reason = failure_reason(exc)
        log.warning("compile='inductor': the compiled program failed at its first run on %s "
                    "(%s); using interpreted replay.", self.device, reason)
        self._compiled = {**(self._compiled or {}), "fallback": reason, "failed_at": "first run"}
        self._mode = self._policy.first_run_failed(reason)
        self._decider = None
        self._replay_fn = build_replay(self._steps, self._inputs)
        return self._replay_fn

    def _compile_fn(self) -> Any:
        """``compile_program`` with this graph's ``compile_options``: with ``freeze``, told what
        the whole program writes (a stretch of a segmented program must not freeze what another
        stretch writes); with ``cpp_wrapper``, told so."""
        opts = self._policy.options
        kwargs: dict[str, Any] = {}
        if opts.freeze:
            kwargs["written"] = written_storages(self._frozen_steps)
        if opts.cpp_wrapper:
            kwargs["cpp_wrapper"] = True
        return functools.partial(compile_program, **kwargs) if kwargs else compile_program
