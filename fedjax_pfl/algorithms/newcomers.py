"""How each algorithm evaluates a client it has never trained (--unseen-clients): one table.

pFL-Bench (Chen et al., NeurIPS 2022) holds out a fraction of clients that never train and
reports their accuracy beside the participating clients' ("participation gap"). A held-out
client is evaluated by the algorithm's own `evaluate`, with no edit per algorithm, because the
engine never samples it (`Engine.sample`): every per-client row of the state stays the row
`init` made, and the shared parts are the ones every client gets. What that evaluation is, per
algorithm, is therefore read off the algorithm's `evaluate` and declared here (the rule each
docs/algorithms/NAME.md states as "Clients that never trained"):

  * GLOBAL: the algorithm's clients use the global model: so does a newcomer.
  * FINE_TUNED: evaluation fine-tunes (Per-FedAvg: adapts) the global model on each client's own
    training data first, a client that trained or not alike: a newcomer is personalised by
    exactly the algorithm's personalisation steps.
  * a personal model kept per client: a newcomer's is its initial row (untrained), combined
    with the shared parts as for any client (a split model's current body with its initial
    head, APFL's mix at its initial α, FedRoD's generic model plus its initial head).

pFedMe and TDPFed train every client every round (only the uploads are sampled): no client can
be held out of training, and --unseen-clients is refused (`REFUSED`).
"""

from __future__ import annotations

GLOBAL = "the global model"
FINE_TUNED = ("the global model fine-tuned on its own training data by the algorithm's "
              "personalisation steps (as every client is at evaluation)")
INITIAL_ROW = ("its initial personal model, an untrained row (the algorithm has no global model "
               "a newcomer could take)")
SPLIT = "the current global body with its initial, untrained head"

# The rule of every registered algorithm (tests/algorithms/test_unseen_clients.py checks that
# every one has an entry, or a refusal).
NEWCOMER_RULES: dict[str, str] = {
    "fedavg": GLOBAL, "fedprox": GLOBAL, "scaffold": GLOBAL, "feddyn": GLOBAL, "moon": GLOBAL,
    "fedavg_sar": GLOBAL, "ffa_lora": GLOBAL,
    "fedavg_ft": FINE_TUNED, "fedprox_ft": FINE_TUNED, "fedbabu": FINE_TUNED,
    "perfedavg": FINE_TUNED,
    "fedper": SPLIT, "lg_fedavg": SPLIT, "fedrep": SPLIT,
    "fedpc": "the current shared part x with its initial personal part z (untrained)",
    "fedrod": "the global generic model plus its initial, untrained personal head",
    "feddpa": "the mixture (1 − λ, λ) of the current global adapter with its initial, untrained "
              "local adapter (λ per input under --feddpa-weighting instance)",
    "apfl": "the mix α·v + (1 − α)·w of its initial local model v with the current global "
            "model w, at its initial α",
    "ditto": "its initial personal model (the initial global model, untrained: Ditto trains a "
             "personal model only where the client is sampled)",
    "local": INITIAL_ROW, "fedamp": INITIAL_ROW, "fedala": INITIAL_ROW, "feddwa": INITIAL_ROW,
    "fedfomo": INITIAL_ROW, "pfedsop": INITIAL_ROW, "pgfed": INITIAL_ROW,
    "pgfed_ce": INITIAL_ROW, "pgfedmo": INITIAL_ROW,
}
# The algorithms that refuse --unseen-clients, and why.
REFUSED: dict[str, str] = {
    "pfedme": "it trains every client each round (only the uploads are sampled)",
    "tdpfed": "it trains every client each round (only the uploads are sampled)",
}


def newcomer_rule(name: str) -> str | None:
    """How algorithm `name` evaluates a client that never trained; None where it refuses
    --unseen-clients (`REFUSED`) or is not declared."""
    return NEWCOMER_RULES.get(name)


# The algorithms whose rounds train every client (client_metrics.npz's rounds_trained counts
# every round for every client).
TRAINS_EVERY_CLIENT = frozenset(REFUSED)
