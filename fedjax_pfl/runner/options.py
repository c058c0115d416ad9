"""A whole run's configuration from its options, by the rules the command line applies.

    from fedjax_pfl.runner import RunConfig
    cfg = RunConfig.from_options(algo="pgfed", dataset="cifar10", clients=50, rounds=100,
                                 lr=0.01, mu=0.1, out="runs/pgfed50")
    cfg = RunConfig.from_options(dataset="femnist", data_dir="~/leaf/femnist", max_clients=100)
    cfg = runner.resume_config("runs/pgfed50", rounds=200)          # continue it to round 200

`python experiments/run.py --FLAG VALUE …` builds its configuration with this same call, so a
notebook gets what the command line gets:

* Each option is a run.py flag's name with `_` for `-` (`--min-size` → `min_size`,
  `--no-memory-check` → `no_memory_check`, `--quiet` → `quiet`, `--conv` → `conv`, `--format`
  → `format`), with the flag's default (`DEFAULTS`); `resume` is True or False (the directory is
  `out`), `model_options` a dict or the flag's "KEY=VALUE,…" text, `log` the sink names as a
  list or the flag's comma-separated text.
* The algorithm's hyperparameters go by their own names (`HParam.name`: `lr`, `mu`, `lam`, not
  the flags `--pgfed-mu`, `--ditto-lam`), as keywords or in `hparams=`. A name that is also an
  option (`alpha`: the Dirichlet α of the partition, and FedDyn's / APFL's α) is the option as a
  keyword; the hyperparameter goes in `hparams={"alpha": …}`.
* The dataset's rules: a natural-client dataset (`formats.NATURAL_DATASETS`: LEAF, TFF or
  FedJAX files) keeps its own clients (`clients` is refused; `max_clients`, `min_samples` take a
  subset) and is the only kind that takes `format`, `max_clients`, `min_samples`, `cache_dir`,
  `token_accuracy` and `quantise`; the partition defaults to `natural` for those and for `synthetic`,
  `dirichlet` otherwise; the client count to `synthetic_clients` for `synthetic`, 20 otherwise;
  each dataset gets the data options its loader takes (`RunConfig.data_options`). ``jsonl``
  (JSON Lines text clients, `data/jsonl.py`) also takes `tokenizer` (required),
  `client_field`, `text_field`, `instruction_field`, `response_field`, `prompt_template`,
  `max_length` and `test_fraction` (its per-client held-out share); ``shakespeare`` and
  ``stackoverflow_nwp`` (TFF's or FedJAX's files) take `tokenizer` too (`data/tff.py`).
* `out` defaults to runs/ALGO_DATASET_TIME.
* An option or hyperparameter given that the run does not use is refused, by one declaration of
  which apply when (`applies_table`): a partition's setting under another scheme, a dataset's
  or a model's under another, a privacy setting without `dp_clip`, `local_epochs` where
  `local_steps` sets the local work, a server optimiser's setting for an algorithm that takes
  none or under another `server_opt`, a reduction's setting for an algorithm that takes none,
  under another `aggregator`, or a robust `aggregator` with `dp_clip`. Where the data live
  (`data_dir`, `tfds_dir`, `download`) is harmless: left at its default with an
  `errors.OptionWarning`, as is a preset's setting the run does not use (`preset=`), so
  config.json never records what no part of the run used.

Errors are `fedjax_pfl.errors.OptionError`s naming these options, raised before anything is
loaded: `str(e)` says "clients does not apply (use max_clients K)", run.py says the same with
its flags. What needs the configuration as a whole (`RunConfig.validate`) or the data
(`runner.prepare`) is checked there, as for any RunConfig.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from typing import Any, Callable, Collection, Mapping

from fedjax_pfl import algorithms
from fedjax_pfl.data.build import PartitionConfig
from fedjax_pfl.errors import OptionError, OptionWarning, arg

# Every option and its default, in run.py's order of the flags.
DEFAULTS: dict[str, Any] = {
    "algo": "fedavg", "rounds": 50, "seed": 0, "eval_every": 1, "target_acc": None,
    "dp_delta": None, "target_epsilon": None, "dp_accountant": "rdp", "eval_clients": "all",
    "unseen_clients": 0.0, "attack_seed": None,
    "rounds_per_call": 1, "state_dtype": "float32", "data_placement": "auto",
    "state_placement": "auto", "no_memory_check": False, "out": None, "checkpoint_every": None,
    "resume": False, "checkpoint_on_signal": None, "log": "", "quiet": False, "model": None,
    "model_options": None, "model_cr": 2.0, "conv": "auto",
    # pretrained models (--model hf:PATH) and adapters (--peft lora; models/lora.py)
    "model_dtype": None, "peft": None, "lora_rank": None, "lora_alpha": None,
    "lora_targets": None, "lora_dropout": None,
    "dataset": "digits", "data_dir": None, "format": None, "max_clients": None, "min_samples": 0,
    "max_client_samples": None,
    # --dataset jsonl (data/jsonl.py; None: the reader's defaults) and pretrained tokenisation
    "tokenizer": None, "client_field": None, "text_field": None, "instruction_field": None,
    "response_field": None, "prompt_template": None, "max_length": None,
    "token_accuracy": None, "quantise": None, "cache_dir": None, "tfds_dir": None,
    "download": False,
    "emnist_split": "balanced", "synthetic_alpha": 1.0, "synthetic_beta": 1.0,
    "synthetic_clients": 30,
    "partition": None, "clients": None, "alpha": 0.5, "min_size": 10, "classes_per_client": 2,
    "shards_per_client": None, "shard_size": None, "clusters": 4, "test_fraction": 0.25,
}
# The options that apply to natural-client datasets only.
NATURAL_ONLY = ("format", "max_clients", "cache_dir", "token_accuracy", "min_samples", "quantise",
                "max_client_samples")
# The options of the JSON Lines text clients only (data/jsonl.py), and the datasets that take a
# pretrained tokenizer (`tokenizer`).
JSONL_ONLY = ("client_field", "text_field", "instruction_field", "response_field",
              "prompt_template", "max_length")
TOKENIZED_DATASETS = ("jsonl", "shakespeare", "stackoverflow_nwp")
# A pretrained model from a local Hugging Face folder: `model` "hf:PATH" (models/hf/).
HF_PREFIX = "hf:"
# The adapters' settings (RunConfig fields of the same names), used with `peft` lora only.
LORA_OPTIONS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
# The datasets read from prepared TFDS copies or their original files (`data.sources`): the ones
# that take `data_dir`, `tfds_dir` and `download` (digits is embedded, synthetic generated).
FILE_DATASETS = ("mnist", "fashion_mnist", "emnist", "cifar10", "cifar100")
# The model a dataset gets without `model` (natural-client datasets: the published model of
# each, docs/results/natural.md).
DEFAULT_MODEL = {"digits": "mlp", "synthetic": "logreg", "mnist": "mlp", "fashion_mnist": "mlp",
                 "emnist": "mlp", "cifar10": "cnn", "cifar100": "cnn",
                 "femnist": "femnist_cnn", "emnist62": "femnist_cnn", "emnist10": "femnist_cnn",
                 "shakespeare": "char_lstm", "stackoverflow_nwp": "word_lstm",
                 "stackoverflow_tp": "tag_logreg", "sent140": "sent_lstm", "celeba": "cnn",
                 "cifar100_fl": "resnet18", "jsonl": "transformer"}

# The option that sets an argument the library's errors name (`errors.arg(name, space)`) where
# the two names differ: RunConfig's fields (""), PartitionConfig's ("partition") and the keys
# of RunConfig.data_options ("data").
_OPTION_OF = {"": {"model_conv": "conv", "memory_check": "no_memory_check", "progress": "quiet"},
              "partition": {"scheme": "partition", "num_clients": "clients"},
              "data": {"fmt": "format"}}


def option_name(name: str, space: str = "") -> str | None:
    """The option of `from_options` that sets the argument an error names (`errors.arg(name,
    space)`): "clients" for ("num_clients", "partition"), "conv" for ("model_conv", ""), the name
    itself for an option; None for a hyperparameter (its name is its keyword) and for an
    argument that no option sets. A front end spells errors with it (run.py: option → flag)."""
    if space == "hparams":
        return None
    option = _OPTION_OF.get(space, {}).get(name, name)
    return option if option in DEFAULTS else None


@dataclasses.dataclass(frozen=True)
class Setting:
    """What decides whether an option or hyperparameter is used (`APPLIES`): the dataset, its
    partition scheme, the model, the algorithm and its resolved hyperparameters (defaults with
    the given ones on top), and which hyperparameters were given (not defaults)."""

    dataset: str
    natural: bool
    scheme: str
    model: str
    algo: str
    hparams: Mapping[str, Any]
    given_hparams: Collection[str]
    peft: str | None = None


@dataclasses.dataclass(frozen=True)
class Applies:
    """When an option (or hyperparameter) is used: `when(setting)`; else `why(setting)` says so
    after its name, and the option is refused (OptionError), or, `harmless` (a setting a user
    keeps in every command line: where the data live), left at its default with an
    OptionWarning."""

    when: Callable[[Setting], bool]
    why: Callable[[Setting], str]
    harmless: bool = False


def _schemes(*schemes: str) -> Applies:
    return Applies(lambda s: s.scheme in schemes,
                   lambda s: f"applies to {arg('partition')} {' / '.join(schemes)} only, not "
                             f"{arg('partition')} {s.scheme}")


def _dataset(*datasets: str, harmless: bool = False) -> Applies:
    return Applies(lambda s: s.dataset in datasets,
                   lambda s: f"applies to {arg('dataset')} {' / '.join(datasets)} only, not "
                             f"{arg('dataset')} {s.dataset}", harmless)


def _natural_only() -> Applies:
    from fedjax_pfl.data.formats import NATURAL_DATASETS

    return Applies(lambda s: s.natural,
                   lambda s: f"applies to natural-client datasets ({', '.join(NATURAL_DATASETS)}), "
                             f"not {arg('dataset')} {s.dataset}")


def _models(names: Collection[str], what: str) -> Applies:
    return Applies(lambda s: s.model in names,
                   lambda s: f"applies to {arg('model')} {what} only, not {arg('model')} "
                             f"{s.model}")


def _with_hparam(name: str, what: str) -> Applies:
    return Applies(lambda s: s.hparams.get(name) is not None,
                   lambda s: f"needs {arg(name, 'hparams')} ({what}): without it nothing uses it")


def _local_epochs() -> Applies:
    def why(s: Setting) -> str:
        k = s.hparams.get("local_steps")
        if "local_steps" in s.given_hparams:
            return (f"and {arg('local_steps', 'hparams')} {k} both set the local work: give one "
                    f"({arg('local_steps', 'hparams')}, when set, replaces the epochs)")
        return (f"does not apply: {arg('algo')} {s.algo} runs {arg('local_steps', 'hparams')} {k} "
                f"by default (steps replace the epochs: give {arg('local_steps', 'hparams')})")
    return Applies(lambda s: s.hparams.get("local_steps") is None, why)


def _server_optimiser(kinds: Collection[str] | None) -> Applies:
    """A server optimiser's setting: for the algorithms that take one
    (`registry.SERVER_OPTIMISED`), with the --server-opt values in `kinds` (None: all)."""
    from fedjax_pfl.algorithms import registry

    def when(s: Setting) -> bool:
        return registry.server_optimiser_refusal(s.algo) is None and (
            kinds is None or s.hparams.get("server_opt") in kinds)

    def why(s: Setting) -> str:
        refusal = registry.server_optimiser_refusal(s.algo)
        if refusal is not None:
            return f"does not apply: {arg('algo')} {s.algo} takes no server optimiser ({refusal})"
        return (f"applies to {arg('server_opt', 'hparams')} {' / '.join(kinds or ())} only, not "
                f"{arg('server_opt', 'hparams')} {s.hparams.get('server_opt')}")
    return Applies(when, why)


def _unseen_clients() -> Applies:
    """--unseen-clients: refused by the algorithms that train every client each round
    (`algorithms.newcomers.REFUSED`)."""
    from fedjax_pfl.algorithms.newcomers import REFUSED

    return Applies(lambda s: s.algo not in REFUSED,
                   lambda s: f"does not apply: {arg('algo')} {s.algo} holds no client out of "
                             f"training ({REFUSED.get(s.algo)})")


def _aggregator(kinds: Collection[str] | None) -> Applies:
    """A reduction's setting: for the algorithms that take a robust rule
    (`registry.ROBUST_AGGREGATED`), without `dp_clip` for a rule other than the mean, with the
    `aggregator` values in `kinds` (None: all)."""
    from fedjax_pfl.algorithms import registry

    def when(s: Setting) -> bool:
        kind = s.hparams.get("aggregator")
        return (registry.aggregator_refusal(s.algo) is None
                and (kind == "mean" or s.hparams.get("dp_clip") is None)
                and (kinds is None or kind in kinds))

    def why(s: Setting) -> str:
        refusal = registry.aggregator_refusal(s.algo)
        kind = s.hparams.get("aggregator")
        if refusal is not None:
            return f"does not apply: {arg('algo')} {s.algo} takes no robust aggregator ({refusal})"
        if kind != "mean" and s.hparams.get("dp_clip") is not None:
            return (f"does not apply with {arg('dp_clip', 'hparams')}: "
                    f"{registry.aggregator_dp_refusal()}")
        return (f"applies to {arg('aggregator', 'hparams')} {' / '.join(kinds or ())} only, not "
                f"{arg('aggregator', 'hparams')} {kind}")
    return Applies(when, why)


def _attack(kinds: Collection[str] | None) -> Applies:
    """An attack's setting: with the `attack` values in `kinds` (None: `attack` itself, whose
    model-poisoning kinds need an algorithm whose uploads go through the server chain,
    `registry.attack_refusal`)."""
    from fedjax_pfl.algorithms import registry

    def when(s: Setting) -> bool:
        kind = s.hparams.get("attack")
        return (registry.attack_refusal(s.algo, kind) is None
                and (kinds is None or kind in kinds))

    def why(s: Setting) -> str:
        kind = s.hparams.get("attack")
        refusal = registry.attack_refusal(s.algo, kind)
        if refusal is not None:
            return f"{kind} does not apply: {arg('algo')} {s.algo} takes none ({refusal})"
        return (f"applies to {arg('attack', 'hparams')} {' / '.join(kinds or ())} only, not "
                f"{arg('attack', 'hparams')} {kind}")
    return Applies(when, why)


def _applies_table() -> dict[tuple[str, str], Applies]:
    from fedjax_pfl.algorithms.registry import AGGREGATOR_SETTINGS, ATTACK_SETTINGS, SERVER_OPT_SETTINGS
    from fedjax_pfl.models import sequence

    natural = _natural_only()
    dp = "client-level DP of the uplink"
    return {
        # the partition's own settings, by scheme (data/partition.py)
        ("alpha", ""): _schemes("dirichlet", "dirichlet_client"),
        ("min_size", ""): _schemes("dirichlet"),
        ("classes_per_client", ""): _schemes("pathological"),
        ("shards_per_client", ""): _schemes("shards"),
        ("shard_size", ""): _schemes("shards"),
        ("clusters", ""): _schemes("clustered"),
        ("test_fraction", ""): Applies(lambda s: not s.natural or s.dataset == "jsonl",
                                       lambda s: f"does not apply: {arg('dataset')} {s.dataset} "
                                                 "keeps its own test split"),
        # the datasets' own settings (data/sources.py, data/formats.py)
        **{(key, ""): natural for key in NATURAL_ONLY},
        **{(key, ""): _dataset("jsonl") for key in JSONL_ONLY},
        ("tokenizer", ""): _dataset(*TOKENIZED_DATASETS),
        ("emnist_split", ""): _dataset("emnist"),
        ("synthetic_alpha", ""): _dataset("synthetic"),
        ("synthetic_beta", ""): _dataset("synthetic"),
        ("synthetic_clients", ""): _dataset("synthetic"),
        ("data_dir", ""): Applies(lambda s: s.natural or s.dataset in FILE_DATASETS,
                                  lambda s: f"does not apply to {arg('dataset')} {s.dataset} "
                                            "(read from no files)", harmless=True),
        ("tfds_dir", ""): _dataset(*FILE_DATASETS, harmless=True),
        ("download", ""): _dataset(*FILE_DATASETS, harmless=True),
        # the models' own settings (models/zoo.py, models/sequence.py)
        ("model_cr", ""): _models(("cp_mlp", "cp_vgg8"), "cp_mlp / cp_vgg8"),
        ("model_dtype", ""): Applies(lambda s: s.model.startswith(HF_PREFIX),
                                     lambda s: f"applies to {arg('model')} hf:PATH only, not "
                                               f"{arg('model')} {s.model}"),
        **{(key, ""): Applies(lambda s: s.peft == "lora",
                              lambda s: f"applies with {arg('peft')} lora only")
           for key in LORA_OPTIONS},
        ("model_options", ""): _models(sequence.SEQUENCE_MODELS,
                                       " / ".join(sequence.SEQUENCE_MODELS)),
        # privacy (runner/privacy.py, algorithms/engine.py's server chain)
        ("dp_delta", ""): _with_hparam("dp_clip", dp),
        ("target_epsilon", ""): _with_hparam("dp_clip", dp),
        ("dp_accountant", ""): _with_hparam("dp_clip", dp),
        ("dp_noise_multiplier", "hparams"): _with_hparam("dp_clip", dp),
        ("dp_clip_quantile", "hparams"): _with_hparam("dp_clip", "the initial clip norm C_0"),
        ("dp_clip_lr", "hparams"): _with_hparam("dp_clip_quantile", "adaptive clipping"),
        ("dp_count_noise", "hparams"): _with_hparam("dp_clip_quantile", "adaptive clipping"),
        # clients that never train (algorithms/engine.py's sampling, algorithms/newcomers.py)
        ("unseen_clients", ""): _unseen_clients(),
        # the adversaries (algorithms/engine.py's malicious set, ops/attacks.py, ops/poison.py)
        ("attack_seed", ""): Applies(lambda s: bool(s.hparams.get("attack_fraction")),
                                     lambda s: f"needs {arg('attack_fraction', 'hparams')} > 0 "
                                               "(the malicious set it draws)"),
        ("attack_redraw", "hparams"): Applies(
            lambda s: bool(s.hparams.get("attack_fraction")),
            lambda s: f"needs {arg('attack_fraction', 'hparams')} > 0 (the malicious set it "
                      "re-draws)"),
        **{(name, "hparams"): _attack(kinds) for name, kinds in ATTACK_SETTINGS.items()},
        ("attack", "hparams"): _attack(None),
        # the local work (algorithms/engine.py: local_steps replaces local_epochs)
        ("local_epochs", "hparams"): _local_epochs(),
        # the server optimiser (algorithms/engine.py's server chain, ops/server_opt.py)
        **{(name, "hparams"): _server_optimiser(kinds)
           for name, kinds in SERVER_OPT_SETTINGS.items()},
        # the reduction (algorithms/engine.py's server chain, ops/robust.py)
        **{(name, "hparams"): _aggregator(kinds)
           for name, kinds in AGGREGATOR_SETTINGS.items()},
    }


def applies_table() -> dict[tuple[str, str], Applies]:
    """The one declaration of which options and hyperparameters a run uses when, keyed by
    (name, space) as `errors.arg` marks them ("" an option, "hparams" a hyperparameter); an
    option or hyperparameter not in it applies to every run (or, a hyperparameter, to the
    algorithms that have it: `_hyperparameters`)."""
    global _APPLIES
    if _APPLIES is None:
        _APPLIES = _applies_table()
    return _APPLIES


_APPLIES: dict[tuple[str, str], Applies] | None = None


def unused(setting: Setting, names: Collection[tuple[str, str]]) -> list[tuple[str, str, Applies]]:
    """(name, space, rule) of each of `names` (given options and hyperparameters, as
    `applies_table` keys them) that the run described by `setting` does not use, in order."""
    table = applies_table()
    return [(name, space, table[name, space]) for name, space in names
            if (name, space) in table and not table[name, space].when(setting)]


def check_algo(algo: str) -> str:
    """`algo`, a registered algorithm (OptionError naming `algo` otherwise)."""
    if algo not in algorithms.names():
        raise OptionError(f"{arg('algo')} must be one of {algorithms.names()}, got {algo!r}")
    return algo


def check_finite(options: Mapping[str, Any]) -> None:
    """Every float option is finite (OptionError naming the first that is not)."""
    for key, value in options.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise OptionError(f"{arg(key)} must be finite, got {value}")


def parse_model_options(options: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A dict as it is; 'hidden=64,output_tanh=true' -> {"hidden": 64, "output_tanh": True}
    (ints, floats, booleans and words)."""
    if isinstance(options, Mapping):
        return dict(options)
    out: dict[str, Any] = {}
    for item in (options or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise OptionError(f"{arg('model_options')} takes KEY=VALUE pairs separated by "
                              f"commas, got {item!r}")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
            continue
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                pass
        else:
            out[key] = value
    return out


def _hyperparameters(algo: str, hparams: Mapping[str, Any] | None,
                     keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The algorithm's hyperparameters from `hparams=` and the keywords that are no option;
    every name one of the algorithm's (OptionError naming it otherwise)."""
    given = dict(hparams or {})
    for name, value in keywords.items():
        if name in given:
            raise OptionError(f"{arg(name, 'hparams')} is given twice, as a keyword and in "
                              f"{arg('hparams')}")
        given[name] = value
    mine = {hp.name for hp, _ in algorithms.spec(algo).all_hparams()}
    for name in given:
        if name in mine:
            continue
        if name == "server_lr":          # (SCAFFOLD's own η_g; --server-lr is server_opt_lr)
            raise OptionError(f"{arg(name, 'hparams')} is SCAFFOLD's η_g; the server "
                              f"optimiser's learning rate is {arg('server_opt_lr', 'hparams')}")
        if any(name in {hp.name for hp, _ in algorithms.spec(a).all_hparams()}
               for a in algorithms.names()):
            raise OptionError(f"{arg(name, 'hparams')} does not apply to {arg('algo')} {algo}")
        raise OptionError(f"unknown option {name!r}: the options are {', '.join(DEFAULTS)}, and "
                          f"{algo}'s hyperparameters {', '.join(sorted(mine))}")
    return given


def _drop_unused(o: dict[str, Any], hparams: dict[str, Any], given: list[str], *,
                 preset: Collection[tuple[str, str]], check_only: Collection[tuple[str, str]] | None,
                 setting: Setting) -> dict[str, Any]:
    """Refuses the given options (`given`, in `o`) and hyperparameters that `setting` does not
    use (OptionError naming the first); resets the harmless ones and a preset's to their
    defaults, one OptionWarning each. Returns the hyperparameters left."""
    names = [(k, "") for k in given] + [(k, "hparams") for k, v in hparams.items() if v is not None]
    if check_only is not None:
        names = [n for n in names if n in check_only]
    kept = dict(hparams)
    for name, space, rule in unused(setting, names):
        text = f"{arg(name, space)} {rule.why(setting)}"
        if not (rule.harmless or (name, space) in preset):
            raise OptionError(text)
        whose = "the preset's value " if (name, space) in preset else ""
        warning = OptionWarning(f"{text}; {whose}left out (not recorded in config.json)")
        warning.harmless = rule.harmless
        warnings.warn(warning, stacklevel=4)
        if space:
            kept.pop(name)
        else:
            o[name] = DEFAULTS[name]
    return kept


def run_fields(*, hparams: Mapping[str, Any] | None = None,
               preset: Collection[tuple[str, str]] = (),
               check_only: Collection[tuple[str, str]] | None = None,
               **options: Any) -> dict[str, Any]:
    """The fields of the RunConfig of a run given by its options (the module docstring says which
    and their rules): what `python experiments/run.py` builds from the same flags
    (`RunConfig.from_options` is `RunConfig(**run_fields(...))`).

    An option or hyperparameter given that the run does not use (`applies_table`: a partition's
    setting under another scheme, a dataset's or a model's under another, a privacy setting
    without `dp_clip`, `local_epochs` where `local_steps` sets the local work) is refused;
    a harmless one (where the data live), or one a preset set, is left at its default with an
    `OptionWarning` saying so (so config.json never records a setting that was not used).

    Args:
      hparams: the algorithm's hyperparameters by name (also accepted as keywords).
      preset: (name, space) of the options ("") and hyperparameters ("hparams") a preset set:
        where they do not apply they are left out with a warning, not refused.
      check_only: (name, space) of those the user gave (the rest carried from a saved run, as
        `resume_config` passes them): only these are checked for applying; None: all given.
      **options: any of `DEFAULTS` (the others keep their defaults) and hyperparameters.

    Raises OptionError naming the option (or hyperparameter) at fault.
    """
    from fedjax_pfl import sinks
    from fedjax_pfl.data.formats import NATURAL_DATASETS
    from fedjax_pfl.interrupts import parse_signal

    keywords = {k: v for k, v in options.items() if k not in DEFAULTS}
    o = {**DEFAULTS, **{k: v for k, v in options.items() if k in DEFAULTS}}
    algo = check_algo(o["algo"] if o["algo"] is not None else "fedavg")
    check_finite(o)
    hparams = _hyperparameters(algo, hparams, keywords)
    dataset = o["dataset"]
    synthetic = dataset == "synthetic"
    natural = dataset in NATURAL_DATASETS
    if natural and o["clients"] is not None:
        raise OptionError(f"{arg('dataset')} {dataset} keeps its own clients: {arg('clients')} "
                          f"does not apply (use {arg('max_clients')} K)")
    scheme = o["partition"] or ("natural" if synthetic or natural else "dirichlet")
    model_options = parse_model_options(o["model_options"])
    # (None, and no model options at all, is what not giving an option gives)
    given = [k for k in options if k in DEFAULTS and options[k] is not None
             and not (k == "model_options" and not model_options)]
    hparams = _drop_unused(o, hparams, given, preset=preset,
                           check_only=check_only, setting=Setting(
                               dataset, natural, scheme, o["model"] or DEFAULT_MODEL.get(dataset, "mlp"),
                               algo, {**{hp.name: hp.default
                                         for hp, _ in algorithms.spec(algo).all_hparams()},
                                      **{k: v for k, v in hparams.items() if v is not None}},
                               {k for k, v in hparams.items() if v is not None}, o["peft"]))
    if o["clients"] is not None:
        clients = o["clients"]
    else:
        clients = o["synthetic_clients"] if synthetic else 20
    partition = PartitionConfig(
        scheme=scheme, num_clients=clients, alpha=o["alpha"], min_size=o["min_size"],
        classes_per_client=o["classes_per_client"], shards_per_client=o["shards_per_client"],
        shard_size=o["shard_size"], clusters=o["clusters"], test_fraction=o["test_fraction"],
        seed=o["seed"],
    )
    data_options = {"data_dir": o["data_dir"], "tfds_dir": o["tfds_dir"], "download": o["download"]}
    if natural:
        data_options = {"data_dir": o["data_dir"], "fmt": o["format"],
                        "max_clients": o["max_clients"], "min_samples": o["min_samples"],
                        "max_client_samples": o["max_client_samples"],
                        "cache_dir": o["cache_dir"],
                        "token_accuracy": o["token_accuracy"] or "default",
                        "quantise": o["quantise"] or "round"}
    model = o["model"]
    if (o["tokenizer"] is None and isinstance(model, str) and model.startswith(HF_PREFIX)
            and dataset in TOKENIZED_DATASETS):
        # A pretrained model's data are tokenised with its own tokenizer.json by default.
        o["tokenizer"] = model[len(HF_PREFIX):]
    if natural and o["tokenizer"] is not None:
        data_options["tokenizer"] = o["tokenizer"]
    if dataset == "jsonl":       # (None: the reader's default; the record keeps what was given)
        data_options.update({key: o[key] for key in ("tokenizer", *JSONL_ONLY)
                             if o[key] is not None}, test_fraction=o["test_fraction"])
    if dataset == "emnist":
        data_options["emnist_split"] = o["emnist_split"]
    if synthetic:
        data_options.update(synthetic_alpha=o["synthetic_alpha"],
                            synthetic_beta=o["synthetic_beta"],
                            synthetic_clients=o["synthetic_clients"])
    out = o["out"] or os.path.join("runs", f"{algo}_{dataset}_{time.strftime('%Y%m%d-%H%M%S')}")
    log = o["log"]
    log = sinks.parse_log_flag(log if log is None or isinstance(log, str) else ",".join(log))
    if o["checkpoint_on_signal"] is not None:
        parse_signal(o["checkpoint_on_signal"])
    adapters = {key: o[key] for key in LORA_OPTIONS if o[key] is not None}
    if o["model_dtype"] is not None:
        adapters["model_dtype"] = o["model_dtype"]
    return dict(algo=algo, dataset=dataset, model=o["model"], peft=o["peft"], **adapters,
                model_options=model_options if o["model_options"] else {},
                model_cr=o["model_cr"], model_conv=o["conv"], partition=partition,
                rounds=o["rounds"], seed=o["seed"], eval_every=o["eval_every"],
                eval_clients=o["eval_clients"], unseen_clients=o["unseen_clients"],
                attack_seed=o["attack_seed"],
                rounds_per_call=o["rounds_per_call"],
                state_dtype=o["state_dtype"], data_placement=o["data_placement"],
                state_placement=o["state_placement"],
                memory_check=not o["no_memory_check"], out=out,
                hparams=hparams, data_options=data_options, progress=not o["quiet"],
                checkpoint_every=o["checkpoint_every"], resume=bool(o["resume"]),
                target_acc=o["target_acc"], log=log,
                checkpoint_on_signal=o["checkpoint_on_signal"], dp_delta=o["dp_delta"],
                target_epsilon=o["target_epsilon"], dp_accountant=o["dp_accountant"])
