"""The shared engine: the client axis, local training, evaluation and metrics."""

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
from fedjax_pfl.core.poisson import (OVERFLOW_PROBABILITY, poisson_capacity, sample_poisson,
                                     truncation_delta)
from fedjax_pfl.core.execution import (
    BACKENDS,
    EAGER_BACKENDS,
    ClientError,
    ClientLoop,
    ClientMapper,
    client_mapper,
    jit_unless_loop,
)
from fedjax_pfl.core.placement import (
    balanced_order,
    client_mask,
    client_mesh,
    replicate,
    to_host,
    replicated_sharding,
    single_device_clients,
)
from fedjax_pfl.core.evaluate import AUTO_EVAL_BATCH, ClientEval, Evaluator, auto_eval_batch
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
from fedjax_pfl.core.metrics import History, summarize
from fedjax_pfl.core.streaming import DATA_PLACEMENTS, Stream
from fedjax_pfl.core.hoststate import STATE_PLACEMENTS, ClientRows, ClientStore, HostState
from fedjax_pfl.core.program import (
    STATE_DTYPES,
    CachedEvaluation,
    MemoryPlan,
    MemoryPlanError,
    Program,
    check_memory,
    prepare_data,
)

__all__ = [
    "broadcast", "gather", "map_clients", "mean_over_clients", "num_sampled_clients",
    "sample_clients", "scatter", "sum_over_clients", "where_clients",
    "OVERFLOW_PROBABILITY", "poisson_capacity", "sample_poisson", "truncation_delta",
    "BACKENDS", "EAGER_BACKENDS", "ClientError", "ClientLoop", "ClientMapper", "client_mapper", "jit_unless_loop",
    "balanced_order", "client_mask", "client_mesh", "replicate", "to_host", "replicated_sharding",
    "single_device_clients",
    "AUTO_EVAL_BATCH", "ClientEval", "Evaluator", "FullPass", "auto_eval_batch", "LocalResult", "LocalTrainer", "add_aux_gradient",
    "epoch_permutation", "masked_mean", "masked_mean_loss", "steps_per_epoch", "History", "summarize",
    "DATA_PLACEMENTS", "Stream", "STATE_PLACEMENTS", "ClientRows", "ClientStore", "HostState", "STATE_DTYPES", "CachedEvaluation", "MemoryPlan", "MemoryPlanError", "Program", "check_memory", "prepare_data",
]
