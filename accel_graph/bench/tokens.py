"""Comparing greedy token sequences where float rounding may legitimately flip a near-tie."""

from __future__ import annotations

from typing import Any

import torch

from ..foundation.tolerances import tolerance_for

__all__ = ["compare_greedy"]


def compare_greedy(prompt_len: int, expected: torch.Tensor, actual: torch.Tensor,
                   logits: list[torch.Tensor]) -> tuple[int, int, list[dict[str, Any]]]:
    """``(tokens compared, near-ties, unexplained mismatches)`` of two greedy outputs ``[B, T]``
    of the same prompt (length ``prompt_len``); ``logits[j]`` are the expected run's logits
    ``[B, vocab]`` of step ``j`` (so token ``j`` was chosen from ``logits[j - 1]``).

    A differing token is a near-tie when the expected run's top-two logits there are within the
    float32 tolerance of each other (both answers are right to rounding); the row is not compared
    further either way, as the sequences diverge from there. Each unexplained mismatch is
    ``{"row", "position", "eager", "graph", "top2_gap"}`` (``eager`` the expected token).
    """
    tol = tolerance_for(torch.float32)
    compared, ties, bad = 0, 0, []
    for r in range(expected.shape[0]):
        for j in range(prompt_len, expected.shape[1]):
            compared += 1
            if expected[r, j] == actual[r, j]:
                continue
            top2 = logits[j - 1][r].topk(2).values.double()
            gap = float(top2[0] - top2[1])
            if gap <= tol.atol + tol.rtol * abs(float(top2[0])):
                ties += 1
            else:
                bad.append({"row": r, "position": j, "eager": int(expected[r, j]),
                            "graph": int(actual[r, j]), "top2_gap": gap})
            break  # the sequences diverge from here on
    return compared, ties, bad
