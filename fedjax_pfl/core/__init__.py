"""The shared engine: the client axis, local training, evaluation, placements and programs.

By role:
  clients            the vocabulary an algorithm crosses the client axis with
  execution          how per-client work runs (the client mapper, its backends)
  local, evaluate    local training and evaluation, written once
  server             the server side of a round: one chain of links over the uploads
  layout, balance    what is per-client in a state; devices' shares of a round
  rows, world        rows that are not an array; a call's client world
  checks             the checks a program's trace returns
  transfer           where arrays move (host ↔ devices, between devices or processes)
  data_placement,    where samples wait (device, host, sharded) and
  sharded
  state_placement,   where state rows wait (device, host: a copy-on-write store)
  store
  placing, program   a program's choice of placements, and the program itself
  memory, cached_evaluation   its memory plan; evaluation of only the models a round changed
"""

from fedjax_pfl.core.balance import balanced_order
from fedjax_pfl.core.cached_evaluation import CachedEvaluation
from fedjax_pfl.core.clients import (
    broadcast,
    gather,
    map_clients,
    mean_over_clients,
    num_sampled_clients,
    sample_clients,
    scatter,
    sum_over_clients,
    where_clients,
)
from fedjax_pfl.core.data_placement import DATA_PLACEMENTS, prepare_data
from fedjax_pfl.core.evaluate import AUTO_EVAL_BATCH, ClientEval, Evaluator, auto_eval_batch
from fedjax_pfl.core.execution import (
    BACKENDS,
    EAGER_BACKENDS,
    ClientError,
    ClientLoop,
    ClientMapper,
    client_mapper,
    jit_unless_loop,
)
from fedjax_pfl.core.layout import client_mask, client_mesh
from fedjax_pfl.core.local import (
    FullPass,
    LocalResult,
    LocalTrainer,
    add_aux_gradient,
    epoch_permutation,
    masked_mean,
    masked_mean_loss,
    steps_per_epoch,
)
from fedjax_pfl.core.memory import MemoryPlan, MemoryPlanError, check_memory
from fedjax_pfl.core.metrics import History, summarize
from fedjax_pfl.core.placing import STATE_DTYPES
from fedjax_pfl.core.poisson import OVERFLOW_PROBABILITY, poisson_capacity, sample_poisson, truncation_delta
from fedjax_pfl.core.program import Program
from fedjax_pfl.core.rows import ClientRows
from fedjax_pfl.core.state_placement import STATE_PLACEMENTS, StoredState
from fedjax_pfl.core.store import ClientStore
from fedjax_pfl.core.transfer import replicated_sharding, to_host

__all__ = [
    "broadcast", "gather", "map_clients", "mean_over_clients", "num_sampled_clients",
    "sample_clients", "scatter", "sum_over_clients", "where_clients",
    "OVERFLOW_PROBABILITY", "poisson_capacity", "sample_poisson", "truncation_delta",
    "BACKENDS", "EAGER_BACKENDS", "ClientError", "ClientLoop", "ClientMapper", "client_mapper",
    "jit_unless_loop", "balanced_order", "client_mask", "client_mesh", "replicated_sharding",
    "to_host", "AUTO_EVAL_BATCH", "ClientEval", "Evaluator", "auto_eval_batch", "FullPass",
    "LocalResult", "LocalTrainer", "add_aux_gradient", "epoch_permutation", "masked_mean",
    "masked_mean_loss", "steps_per_epoch", "History", "summarize", "ClientRows", "ClientStore",
    "DATA_PLACEMENTS", "prepare_data", "STATE_PLACEMENTS", "StoredState", "MemoryPlan",
    "MemoryPlanError", "check_memory", "STATE_DTYPES", "Program", "CachedEvaluation",
]
