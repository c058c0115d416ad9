"""A run's configuration: `RunConfig`, its checks, its record in config.json, and what a resumed
run may change."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from typing import Any

import jax
import numpy as np

from fedjax_pfl import algorithms, core, models
from fedjax_pfl.data.build import PartitionConfig
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.runner import options as options_lib

DEFAULT_CHECKPOINT_EVERY = 10
# Configuration that may change when a run is resumed (everything else must match).
# model_conv changes float rounding only (the same convolution, computed another way).
# (--data-placement and --state-placement move the same samples and rows: the rounds are the
# same bit for bit either way.)
# compile_cache: a cached executable is the one the compile would give (the same bits).
RESUMABLE_CHANGES = ("rounds", "out", "progress", "memory_check", "checkpoint_every", "resume",
                     "overwrite", "target_acc", "model_conv", "log", "checkpoint_on_signal",
                     "data_placement", "state_placement", "compile_cache", "export")
# Models whose strided stages collapse small images (8×8 digits) to 1×1: they train at chance.
MIN_IMAGE_SIDE = {"resnet9": 16, "resnet18": 16}


DEFAULT_MODEL = options_lib.DEFAULT_MODEL     # (declared with the options that depend on it)


@dataclasses.dataclass
class RunConfig:
    """Everything a run needs. `hparams` holds the algorithm's hyperparameters (CLI or notebook)."""

    algo: str = "fedavg"
    dataset: str = "digits"
    model: str | None = None
    model_cr: float = 2.0
    model_conv: str = "auto"              # how convolutions are computed (models.CONV_IMPLS)
    model_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # text models' sizes
    # --model hf:PATH: the base weights' dtype (models.hf.DTYPES).
    model_dtype: str = "float32"
    # LoRA adapters as the trained (and per-client) parameters over the frozen model
    # (models/lora.py): None (every weight trained) or "lora"; PEFT's r, lora_alpha,
    # target_modules (comma-separated module names or paths, or "all") and lora_dropout.
    peft: str | None = None
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: str = "q_proj,v_proj"
    lora_dropout: float = 0.0
    partition: PartitionConfig = dataclasses.field(default_factory=PartitionConfig)
    rounds: int = 50
    seed: int = 0
    eval_every: int = 1
    eval_clients: str = "all"
    # Clients that never train (pFL-Bench's unseen_clients_rate): ⌈FRAC·N⌉ clients, drawn once
    # from `seed`, are left out of every round's sampling and evaluated as newcomers
    # (algorithms/engine.py `unseen_ids`, algorithms/newcomers.py); in [0, 1).
    unseen_clients: float = 0.0
    # The seed of the malicious set (hparams["attack_fraction"]; algorithms/engine.py
    # `malicious_mask`): None draws it from `seed`.
    attack_seed: int | None = None
    rounds_per_call: int = 1
    state_dtype: str = "float32"
    data_placement: str = "auto"          # where client samples wait between rounds (core.data_placement)
    state_placement: str = "auto"         # where client state rows wait between rounds (core.state_placement)
    memory_check: bool = True
    out: str | None = None
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
    data_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool = True
    checkpoint_every: int | None = None   # None: every 10 rounds (a multiple of rounds_per_call)
    resume: bool = False                  # continue from the latest checkpoint in `out`
    target_acc: float | None = None       # stop after the first evaluation with acc_mean >= this
    log: tuple[str, ...] = ()             # metric sinks (fedjax_pfl.sinks): tensorboard, mlflow, wandb
    checkpoint_on_signal: str | None = None  # e.g. "USR1": checkpoint at the next round boundary
    # Client-level DP (with hparams["dp_clip"]; runner/privacy.py): δ of the reported ε (None:
    # N^-1.1), the ε to reach after `rounds` (sets the noise multiplier), the accountant.
    dp_delta: float | None = None
    target_epsilon: float | None = None
    dp_accountant: str = "rdp"
    # JAX's persistent compilation cache (`fedjax_pfl.compile_cache`): True, the default
    # directory ($FEDJAX_PFL_COMPILE_CACHE, the user's own JAX cache, ~/.cache/fedjax_pfl/jax;
    # none with $FEDJAX_PFL_COMPILE_CACHE=off); a directory; False, none (--no-compile-cache).
    # Set by `prepare` before anything compiles; a directory it cannot use safely: one warning.
    compile_cache: bool | str = True
    # Write the final server and personal models to OUT/final/ as safetensors files with a
    # model.json (`fedjax_pfl.export`; --export). Needs `out`; a multi-process run refuses it.
    export: bool = False

    @classmethod
    def from_options(cls, *, hparams: dict[str, Any] | None = None, **options: Any) -> "RunConfig":
        """The configuration run.py builds from the same flags, by their names (`rounds=100`,
        `clients=50`, `min_size=40`, `data_dir=…`) with the algorithm's hyperparameters as
        keywords or in `hparams=`: the defaults per dataset, the natural-client datasets' rules,
        the data options and the default `out` (`fedjax_pfl.runner.options`); an option the run
        does not use refused (`options.applies_table`; `preset=` and `check_only=` as
        `options.run_fields` takes them)."""
        return cls(**options_lib.run_fields(hparams=hparams, **options))

    @property
    def natural(self) -> bool:
        """Whether `dataset` is a natural-client dataset (LEAF / TFF / FedJAX files)."""
        from fedjax_pfl.data.formats import NATURAL_DATASETS

        return self.dataset in NATURAL_DATASETS

    def checkpoint_interval(self) -> int:
        """Rounds between checkpoints, also written after the last round (0: none; none either
        without `out`)."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        k = self.rounds_per_call
        return k * max(1, math.ceil(DEFAULT_CHECKPOINT_EVERY / k))

    def validate(self) -> dict[str, Any]:
        """Checks everything that needs no data; returns the resolved algorithm hyperparameters.
        Errors are OptionErrors naming the field (`errors.arg`)."""
        spec = algorithms.spec(self.algo)
        for name in ("rounds", "seed", "eval_every", "rounds_per_call"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise OptionError(f"{arg(name)} must be an integer, got {value!r}")
        if not 0 <= self.seed < 2**32:
            raise OptionError(f"{arg('seed')} must be in [0, 2**32), got {self.seed}")
        if self.rounds < 1:
            raise OptionError(f"{arg('rounds')} must be >= 1, got {self.rounds}")
        if self.eval_every < 1:
            raise OptionError(f"{arg('eval_every')} must be >= 1, got {self.eval_every}")
        from fedjax_pfl.data import sources
        from fedjax_pfl.data.formats import NATURAL_DATASETS

        if self.dataset not in sources.DATASETS and not self.natural:
            raise OptionError(f"{arg('dataset')} must be one of {list(sources.DATASETS)} or a "
                              f"natural-client dataset {list(NATURAL_DATASETS)}, got "
                              f"{self.dataset!r}")
        if (self.partition.scheme == "natural" and self.dataset != "synthetic"
                and not self.natural):
            raise OptionError(f"{arg('scheme', 'partition')} natural keeps a dataset's own "
                              f"clients: synthetic's or a natural-client dataset's, not "
                              f"{arg('dataset')} {self.dataset}'s")
        hf = self.model is not None and self.model.startswith(options_lib.HF_PREFIX)
        if hf and not self.model[len(options_lib.HF_PREFIX):]:
            raise OptionError(f"{arg('model')} hf:PATH needs the folder PATH, got {self.model!r}")
        if self.model_dtype not in ("float32", "bfloat16"):
            raise OptionError(f"{arg('model_dtype')} must be float32 or bfloat16, got "
                              f"{self.model_dtype!r}")
        if self.peft not in (None, "lora"):
            raise OptionError(f"{arg('peft')} must be lora (or not given), got {self.peft!r}")
        if self.peft == "lora":
            if isinstance(self.lora_rank, bool) or int(self.lora_rank) != self.lora_rank or self.lora_rank < 1:
                raise OptionError(f"{arg('lora_rank')} must be an integer >= 1, got {self.lora_rank!r}")
            if not self.lora_alpha > 0:
                raise OptionError(f"{arg('lora_alpha')} must be > 0, got {self.lora_alpha!r}")
            if not 0.0 <= self.lora_dropout < 1.0:
                raise OptionError(f"{arg('lora_dropout')} must be in [0, 1), got {self.lora_dropout!r}")
            if not [t for t in str(self.lora_targets).split(",") if t.strip()]:
                raise OptionError(f"{arg('lora_targets')} names no module, got {self.lora_targets!r}")
        if self.model is not None and not hf and self.model not in models.MODELS:
            raise OptionError(f"{arg('model')} must be one of {list(models.MODELS)}, got "
                              f"{self.model!r}")
        if self.model is None or self.model in models.MODELS:
            from fedjax_pfl.models import sequence

            if not isinstance(self.model_options, dict):
                raise OptionError(f"{arg('model_options')} must be a dict of KEY: VALUE, got "
                                  f"{self.model_options!r}")
            sequence.check_options(model_name_of(self), self.model_options)
        if not self.model_cr >= 1:
            raise OptionError(f"{arg('model_cr')} must be >= 1, got {self.model_cr}")
        if self.model_conv not in models.CONV_IMPLS:
            raise OptionError(f"{arg('model_conv')} must be one of {list(models.CONV_IMPLS)}, got "
                              f"{self.model_conv!r}")
        if self.state_dtype not in core.STATE_DTYPES:
            raise OptionError(f"{arg('state_dtype')} must be one of {list(core.STATE_DTYPES)}, "
                              f"got {self.state_dtype!r}")
        if self.rounds_per_call < 1:
            raise OptionError(f"{arg('rounds_per_call')} must be >= 1, got {self.rounds_per_call}")
        if self.dp_delta is not None and not 0 < self.dp_delta < 1:
            raise OptionError(f"{arg('dp_delta')} must be in (0, 1), got {self.dp_delta}")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise OptionError(f"{arg('target_epsilon')} must be > 0, got {self.target_epsilon}")
        if self.dp_accountant not in ("rdp", "pld"):
            raise OptionError(f"{arg('dp_accountant')} must be one of ['rdp', 'pld'], "
                              f"got {self.dp_accountant!r}")
        if self.data_placement not in core.DATA_PLACEMENTS:
            raise OptionError(f"{arg('data_placement')} must be one of "
                              f"{list(core.DATA_PLACEMENTS)}, got {self.data_placement!r}")
        if self.state_placement not in core.STATE_PLACEMENTS:
            raise OptionError(f"{arg('state_placement')} must be one of "
                              f"{list(core.STATE_PLACEMENTS)}, got {self.state_placement!r}")
        if self.eval_every % self.rounds_per_call:
            raise OptionError(f"{arg('eval_every')} {self.eval_every} must be a multiple of "
                              f"{arg('rounds_per_call')} {self.rounds_per_call} (evaluation runs "
                              "between calls)")
        if self.checkpoint_every is not None:
            if self.checkpoint_every < 0:
                raise OptionError(f"{arg('checkpoint_every')} must be >= 0, got "
                                  f"{self.checkpoint_every}")
            if self.checkpoint_every % self.rounds_per_call:
                raise OptionError(f"{arg('checkpoint_every')} {self.checkpoint_every} must be a "
                                  f"multiple of {arg('rounds_per_call')} {self.rounds_per_call} "
                                  "(checkpoints are written between calls)")
        if not math.isfinite(self.model_cr):
            raise OptionError(f"{arg('model_cr')} must be finite, got {self.model_cr}")
        if self.target_acc is not None and (isinstance(self.target_acc, bool) or not isinstance(
                self.target_acc, (int, float, np.integer, np.floating)) or not 0 < self.target_acc <= 1):
            raise OptionError(f"{arg('target_acc')} must be in (0, 1] (a mean client accuracy), "
                              f"got {self.target_acc}")
        parse_eval_clients(self.eval_clients)
        if (isinstance(self.unseen_clients, bool)
                or not isinstance(self.unseen_clients, (int, float, np.integer, np.floating))
                or not 0 <= self.unseen_clients < 1):
            raise OptionError(f"{arg('unseen_clients')} must be in [0, 1) (a fraction of the "
                              f"clients), got {self.unseen_clients!r}")
        if self.attack_seed is not None and (isinstance(self.attack_seed, bool) or not isinstance(
                self.attack_seed, (int, np.integer)) or not 0 <= self.attack_seed < 2**32):
            raise OptionError(f"{arg('attack_seed')} must be an integer in [0, 2**32), got "
                              f"{self.attack_seed!r}")
        from fedjax_pfl.compile_cache import check_setting

        check_setting(self.compile_cache)
        from fedjax_pfl.export import check_run

        check_run(self.export, self.out)
        if self.checkpoint_on_signal is not None:
            from fedjax_pfl.interrupts import parse_signal

            parse_signal(self.checkpoint_on_signal)
        if self.log:
            from fedjax_pfl import sinks

            sinks.parse_log_flag(",".join(self.log))
        self.partition.validate()
        if self.natural:
            check_natural_options(self.dataset, self.data_options, self.partition)
        hparams = spec.resolve(self.hparams)
        for hp, _ in spec.all_hparams():
            value = hparams.get(hp.name)
            if hp.type is float and value is not None and not math.isfinite(value) and not (
                    hp.name == "dp_clip" and value == math.inf):     # inf: clipping off
                raise OptionError(f"{arg(hp.name, 'hparams')} must be finite, got {value}")
        if self.rounds_per_call > 1 and hparams["backend"] in core.EAGER_BACKENDS:
            raise OptionError(f"{arg('rounds_per_call')} needs {arg('backend', 'hparams')} chunked "
                              f"or vmap (the {hparams['backend']} backend runs one client at a "
                              "time from Python)")
        return hparams


def check_natural_options(dataset: str, options: dict, partition: PartitionConfig) -> None:
    """The settings of a natural-client dataset that need no files (OptionError naming the
    data option or the partition's field)."""
    from fedjax_pfl.data.formats import NATURAL_DATASETS
    from fedjax_pfl.data.natural import check_quantise

    if partition.scheme != "natural":
        raise OptionError(f"{arg('dataset')} {dataset} keeps its own clients: "
                          f"{arg('scheme', 'partition')} {partition.scheme} does not apply (use "
                          f"{arg('max_clients', 'data')} / {arg('min_samples', 'data')})")
    fmt = options.get("fmt")
    if fmt is not None and fmt not in NATURAL_DATASETS[dataset]:
        raise OptionError(f"{arg('fmt', 'data')} must be one of {list(NATURAL_DATASETS[dataset])} "
                          f"for {arg('dataset')} {dataset}, got {fmt!r}")
    check_quantise(options.get("quantise", "round"))
    k, s = options.get("max_clients"), options.get("min_samples", 0)
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
        raise OptionError(f"{arg('max_clients', 'data')} must be an integer >= 1, got {k!r}")
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
        raise OptionError(f"{arg('min_samples', 'data')} must be an integer >= 0, got {s!r}")
    c = options.get("max_client_samples")
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1):
        raise OptionError(f"{arg('max_client_samples', 'data')} must be an integer >= 1, got {c!r}")
    if not options.get("data_dir"):
        raise OptionError(f"{arg('dataset')} {dataset} reads natural-client files: give "
                          f"{arg('data_dir', 'data')} DIR (README, 'Natural federated datasets')")


def model_name_of(cfg: RunConfig) -> str:
    """`model`, or the dataset's default model."""
    return cfg.model or DEFAULT_MODEL.get(cfg.dataset, "mlp")


def parse_eval_clients(value: str) -> str | int:
    """'all', 'participants', or K (a fixed random subset of K clients)."""
    value = str(value)
    if value in ("all", "participants"):
        return value
    try:
        k = int(value)
    except ValueError:
        raise OptionError(f"{arg('eval_clients')} must be 'all', 'participants' or a number of "
                          f"clients, got {value!r}") from None
    if k < 1:
        raise OptionError(f"{arg('eval_clients')} must be >= 1, got {k}")
    return k


def config_record(cfg: RunConfig, hparams: dict, model_name: str, data_info: dict) -> dict:
    record = dataclasses.asdict(cfg)
    if isinstance(cfg.compile_cache, os.PathLike):       # (a pathlib.Path from a notebook)
        record["compile_cache"] = os.fspath(cfg.compile_cache)
    record["hparams"] = hparams
    record["model"] = model_name
    # Natural clients' ids (an array, up to 342,477 of them) go to client_metrics.npz instead.
    record["data"] = {k: v for k, v in data_info.items() if k != "client_ids"}
    record["versions"] = {"python": platform.python_version(), "jax": jax.__version__,
                          "numpy": np.__version__}
    return record


# What a finished run's results do not depend on: a run that differs from a saved one only here
# may reuse its results (compare.py and sweep.py --resume). --rounds, --target-acc and --conv
# change what the run reports, so they must match.
REUSABLE_CHANGES = ("out", "progress", "memory_check", "checkpoint_every", "resume", "overwrite",
                    "log", "checkpoint_on_signal", "data_placement", "state_placement",
                    "compile_cache", "export")

_RESUME_TAIL = (f"only {arg('rounds')}, {arg('checkpoint_every')}, {arg('target_acc')}, "
                f"{arg('model_conv')}, {arg('log')}, {arg('checkpoint_on_signal')}, "
                f"{arg('data_placement')}, {arg('state_placement')}, {arg('progress')} and "
                f"{arg('memory_check')} may change")


def resume_conflicts(cfg: RunConfig, hparams: dict, model_name: str, saved: dict) -> str | None:
    """The first setting of `cfg` that differs from the saved run's config.json record, as a
    one-line message naming it (marked, `errors.arg`: raise it as an OptionError or say it with
    `errors.render`); None when the run may resume."""
    found = config_conflict(cfg, hparams, model_name, saved, may_change=RESUMABLE_CHANGES)
    return None if found is None else (f"{arg('resume')}: the run in {cfg.out} was made with "
                                       f"{found} ({_RESUME_TAIL})")


def reuse_conflicts(cfg: RunConfig, hparams: dict, model_name: str, saved: dict) -> str | None:
    """The first setting of `cfg` that differs from a finished run's config.json record, where
    any difference but `REUSABLE_CHANGES` would change its results: a message naming the setting
    ("lr 0.1, not 0.05", marked as `resume_conflicts`'), or None when the saved results are this
    configuration's."""
    return config_conflict(cfg, hparams, model_name, saved, may_change=REUSABLE_CHANGES)


def config_conflict(cfg: RunConfig, hparams: dict, model_name: str, saved: dict, *,
                    may_change: tuple[str, ...]) -> str | None:
    """"NAME SAVED, not MINE" for the first setting outside `may_change` in which `cfg` (with its
    resolved `hparams`) and a saved config.json record differ, NAME marked (`errors.arg`: a
    field of RunConfig, of its partition, a data option, a hyperparameter); None where none
    does. With `target_epsilon` the saved noise multiplier is the one it called for, so it is
    compared through `target_epsilon` (and the privacy settings) alone."""
    mine = config_record(cfg, hparams, model_name, {})
    derived = {("hparams", "dp_noise_multiplier")} if cfg.target_epsilon is not None else set()
    for key in sorted(set(mine) | set(saved)):
        if key in may_change or key in ("data", "versions", "devices", "compression"):
            continue
        a, b = mine.get(key), saved.get(key)
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            for sub in sorted(set(a) | set(b)):
                if key == "data_options" and sub in ("data_dir", "tfds_dir", "download"):
                    continue
                if (key, sub) in derived:
                    continue
                if key == "hparams" and sub not in b and _at_default(cfg.algo, sub, a.get(sub)):
                    continue
                if a.get(sub) != b.get(sub) and not (key == "hparams" and
                                                     _same_number(a.get(sub), b.get(sub))):
                    return f"{_setting(key, sub)} {b.get(sub)!r}, not {a.get(sub)!r}"
        elif key not in saved and _at_field_default(key, a):
            continue           # (a record made before the field existed was made at its default)
        elif a != b and not _same_number(a, b):
            return f"{arg(key)} {b!r}, not {a!r}"
    return None


def _at_field_default(key: str, value: Any) -> bool:
    """Whether RunConfig field `key` (one added after runs were saved: --unseen-clients) is at
    its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)
                if f.default is not dataclasses.MISSING}
    return key in _ADDED_FIELDS and key in defaults and value == defaults[key]


# RunConfig fields added after runs were recorded: a saved record without one is at its default.
_ADDED_FIELDS = ("unseen_clients", "attack_seed")


def _at_default(algo: str, name: str, value: Any) -> bool:
    """Whether hyperparameter `name` of `algo` is at its default: a saved record without it (a
    run made before it existed, e.g. before --server-opt) was made with that default."""
    defaults = {hp.name: hp.default for hp, _ in algorithms.spec(algo).all_hparams()}
    return name in defaults and value == defaults[name]


def record_differences(a: dict, b: dict, *, may_change: tuple[str, ...] = RESUMABLE_CHANGES
                       ) -> list[str]:
    """The settings (marked, `errors.arg`, in order) in which two config.json records differ,
    outside `may_change` and what is no setting (the data's description, the versions, where
    the data live, the compression a rank rule derived from the rate given): e.g. a run's
    config.json against the configuration its checkpoint saved."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key in may_change or key in ("data", "versions", "devices", "compression"):
            continue
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) or isinstance(y, dict):
            x, y = x or {}, y or {}
            for sub in sorted(set(x) | set(y)):
                if key == "data_options" and sub in ("data_dir", "tfds_dir", "download"):
                    continue
                if x.get(sub) != y.get(sub) and not _same_number(x.get(sub), y.get(sub)):
                    out.append(_setting(key, sub))
        elif x != y and not _same_number(x, y):
            out.append(arg(key))
    return out


def _same_number(a, b) -> bool:
    return (isinstance(a, (int, float)) and isinstance(b, (int, float))
            and not isinstance(a, bool) and not isinstance(b, bool) and float(a) == float(b))


# The space (`errors.arg`) of the entries of a record's dict-valued settings.
_SPACES = {"partition": "partition", "data_options": "data", "hparams": "hparams"}


def _setting(key: str, sub: str) -> str:
    """Entry `sub` of the record's dict `key`, marked: a partition field, a data option, a
    hyperparameter, or a model option (as `model_options NAME`)."""
    if key in _SPACES:
        return arg(sub, _SPACES[key])
    return f"{arg(key)} {sub}"


def read_config(out: str) -> dict:
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


def config_from_record(record: dict) -> RunConfig:
    """The RunConfig a config.json record describes (to resume a run from its directory)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    kwargs = {k: v for k, v in record.items() if k in fields}
    kwargs["partition"] = PartitionConfig(**record["partition"])
    kwargs["hparams"] = dict(record.get("hparams", {}))
    return RunConfig(**kwargs)


def check_unseen_clients(cfg: RunConfig, hparams: dict, num_real: int) -> None:
    """The --unseen-clients checks that need the clients (OptionError in one line): the
    held-out ⌈FRAC·N⌉ must leave at least the M = ⌊N·rate⌋ clients a round samples (one
    under Poisson sampling). `runner.prepare` calls it."""
    from fedjax_pfl.algorithms import engine

    if not cfg.unseen_clients:
        return
    config, _ = engine.EngineConfig.split({**hparams, "unseen_clients": cfg.unseen_clients})
    engine.check_unseen(config, num_real)        # (OptionError naming the options)


def attack_seed_of(cfg: RunConfig) -> int:
    """The seed of the run's malicious set: --attack-seed, or --seed where not given."""
    return int(cfg.seed if getattr(cfg, "attack_seed", None) is None else cfg.attack_seed)
