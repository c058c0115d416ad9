"""Metric sinks: TensorBoard, MLflow and Weights & Biases as round-end callbacks.

Chosen on the command line with `--log tensorboard,mlflow,wandb`; each is a
`fedjax_pfl.callbacks.Callback` and an optional extra, installed on its own:

    pip install "fedjax_pfl[tensorboard]"   event files under OUT/tensorboard/, written with the
                                            tensorboard package's own writer (no TensorFlow)
    pip install "fedjax_pfl[mlflow]"        one MLflow run per run, in OUT/mlflow.db (a local
                                            SQLite store) unless $MLFLOW_TRACKING_URI is set
    pip install "fedjax_pfl[wandb]"         one W&B run, offline (OUT/wandb/) unless $WANDB_MODE
                                            is set; `wandb sync OUT/wandb/offline-run-*` uploads it
    pip install "fedjax_pfl[log]"           all three

Every sink logs a round's `callbacks.scalars(row)` with step = the round number, so the three
tools agree with metrics.jsonl round for round. A resumed run (RunStart.first_round > 0) continues
the same MLflow and W&B run (their ids are kept in OUT/mlflow_run_id and OUT/wandb_run_id) and
the same TensorBoard run directory (a restart marker makes TensorBoard drop the rounds after the
checkpoint that the resumed run computes again).

A notebook builds them the same way: `run(cfg, callbacks=sinks.make(("mlflow",), cfg.out))`.
"""

from __future__ import annotations

import importlib
from typing import Iterable

from fedjax_pfl.callbacks import Callback
from fedjax_pfl.errors import MarkedError, OptionError, arg

SINKS = ("tensorboard", "mlflow", "wandb")

# What each sink writes into the run directory: a run that starts afresh in an old directory
# removes these with the run's own files (the run-directory module's list of run files).
RUN_FILES = ("tensorboard", "mlflow.db", "mlflow_run_id", "mlartifacts", "wandb", "wandb_run_id")

# The top-level modules each sink imports, whose absence the extra of the same name fixes
# (MLflow's SQLite store needs SQLAlchemy and Alembic, which mlflow-skinny does not bring).
_LIBRARIES = {
    "tensorboard": ("tensorboard",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
    "wandb": ("wandb",),
}


class MissingExtraError(MarkedError, ImportError):
    """A sink's library is not installed; the message names the pip extra that installs it
    (and the run's `log` option, `errors.arg`)."""


def parse_log_flag(text: str | None) -> tuple[str, ...]:
    """The sink names of `--log` ("tensorboard,mlflow"), in order, without repeats.

    "" or "none" (any case) means no sink. Raises OptionError, one line naming `log` and the
    valid names, for any other name.
    """
    if text is None or text.strip().lower() in ("", "none"):
        return ()
    names: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if name not in SINKS:
            raise OptionError(f"{arg('log')}: unknown sink {part.strip()!r}; valid names: "
                              f"{', '.join(SINKS)} (comma-separated), or none")
        if name not in names:
            names.append(name)
    return tuple(names)


def make(names: Iterable[str], out: str | None, quiet: bool = False) -> list[Callback]:
    """One callback per sink name, writing under the run directory `out` (None: the run's
    RunStart.out is used); `quiet` (--quiet): the sinks' libraries print nothing of their own.

    Each library is imported here, when its sink is asked for, so the package never needs one
    that is not used. A missing library raises MissingExtraError with the install command, e.g.
    `log mlflow needs mlflow (not installed): pip install "fedjax_pfl[mlflow]"`.
    """
    sinks: list[Callback] = []
    for name in names:
        if name not in SINKS:
            raise OptionError(f"{arg('log')}: unknown sink {name!r}; valid names: "
                              f"{', '.join(SINKS)}")
        try:
            module = importlib.import_module(f"fedjax_pfl.sinks.{name}")
            sinks.append(module.Sink(out, quiet=quiet))
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            if missing not in _LIBRARIES[name]:
                raise
            raise MissingExtraError(
                f'{arg("log")} {name} needs {missing} (not installed): '
                f'pip install "fedjax_pfl[{name}]"') from None
    return sinks
