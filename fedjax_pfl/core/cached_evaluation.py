"""Evaluation that evaluates a client's personalised model again only when a round has changed
it (`CachedEvaluation`)."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from fedjax_pfl.core.evaluate import default_eval_group

Params = Any


class Evaluates(Protocol):
    """What `CachedEvaluation` reads of a program (`core.Program`)."""

    algo: Any
    data: Any
    num_clients: int

    def evaluate(self, state: Params, ids: np.ndarray | None = None) -> dict: ...
    def evaluate_part(self, part: str, state: Params, ids: np.ndarray | None = None) -> dict: ...


class CachedEvaluation:
    """`Program.evaluate` that evaluates a client's personalised model again only when a round
    has changed it.

    For an algorithm with `evaluate_parts` (PGFed, Ditto, pFedSOP, Local: a personalised model
    per client that only the rounds sampling the client change), the "rows" entries of a client
    not sampled since its last evaluation are the values kept from then, which a new evaluation
    of the same model on the same test data would repeat; the "rest" entries (the global model)
    are evaluated every time. With 6 of 25 clients sampled a round, PGFed's personal evaluation
    costs 8/25 of a full one. Rows are always evaluated in groups of `group` clients (default:
    the power of two at or above the clients sampled a round; a repeated id pads the last group)
    by one program, so a client's numbers do not depend on when or beside whom it was evaluated:
    a run resumed from a checkpoint, whose cache starts empty, reports the same bits as a run
    that never stopped. Without `evaluate_parts` it is `Program.evaluate`.

        evaluation = CachedEvaluation(program)
        state, per_round = program.run_rounds(state, keys, r, 1)
        evaluation.changed(per_round[0]["sampled"])
        evals = evaluation(state)              # or evaluation(state, ids)
    """

    def __init__(self, program: Evaluates, group: int | None = None):
        self.program = program
        self.parts = program.algo.evaluate_parts
        n = program.num_clients
        if group is None:
            group = default_eval_group(program.algo, program.data)
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        self.group = min(group, n)
        self.cache: dict | None = None                      # row entries, host arrays [N, ...]
        self.current = np.zeros(n, bool)                    # cache holds client i's value now

    def changed(self, clients) -> None:
        """Clients whose state rows a round changed: the round's metrics' "sampled"."""
        self.current[np.asarray(clients, np.int64).ravel()] = False

    def __call__(self, state: Params, ids: np.ndarray | None = None) -> dict:
        if self.parts is None:
            return self.program.evaluate(state, ids)
        n = self.program.num_clients
        want = np.arange(n) if ids is None else np.asarray(ids, np.int64)
        todo = np.unique(want[~self.current[want]])
        for start in range(0, todo.size, self.group):
            rows = todo[start:start + self.group]
            padded = np.concatenate([rows, np.full(self.group - rows.size, rows[0])])
            fresh = self.program.evaluate_part("rows", state, padded)
            if self.cache is None:
                self.cache = jax.tree.map(lambda a: np.zeros((n,) + a.shape[1:], a.dtype), fresh)
            for cached, new in zip(jax.tree.leaves(self.cache), jax.tree.leaves(fresh), strict=True):
                cached[rows] = new[: rows.size]
        self.current[todo] = True
        kept = {name: jax.tree.map(lambda a: a[want], entry) for name, entry in self.cache.items()}
        return {**kept, **self.program.evaluate_part("rest", state, ids)}
