#!/usr/bin/env python
"""Command line: flags -> validated RunConfig -> fedjax_pfl.runner.run. No math here.

    python experiments/run.py --algo fedavg                       # embedded digits, 20 clients
    python experiments/run.py --algo pgfedmo --rounds 100
    python experiments/run.py --preset pgfed_paper --dataset fashion_mnist --algo pgfed
    python experiments/run.py --resume runs/pgfed_digits_20260101-120000   # after Ctrl-C / a crash

Every algorithm's hyperparameters are flags (`--help` lists them with their defaults per
algorithm). Bad input exits with status 2 and a one-line message naming the flag, before any
computation. Ctrl-C ends a run with status 130, leaving its record (metrics, an interrupted
summary, the last checkpoint) in --out.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def _presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str):
        _fail(f"{message} (see --help)")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" only to help texts that do not already state their default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text.lower() or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)




def build_parser() -> argparse.ArgumentParser:
    from fedjax_pfl import algorithms
    from fedjax_pfl.algorithms import COMMON_HPARAMS
    from fedjax_pfl.data import partition as partition_lib
    from fedjax_pfl.data import sources
    from fedjax_pfl.data.formats import FORMATS, NATURAL_DATASETS
    from fedjax_pfl import models

    p = _Parser(
        prog="run.py", description="Simulate a (personalised) federated learning algorithm.",
        formatter_class=_DefaultsFormatter,
        epilog="Algorithms: " + "; ".join(
            f"{n}: {algorithms.spec(n).summary}" for n in algorithms.names()),
    )
    g = p.add_argument_group("run")
    g.add_argument("--algo", default=None,
                   help=f"algorithm, one of {algorithms.names()} (default fedavg; required with "
                        "a --preset that does not name one)")
    g.add_argument("--preset", default=None,
                   help=f"load defaults from experiments/configs/NAME.json; explicit flags win. "
                        f"Available: {_presets()}")
    g.add_argument("--rounds", type=int, default=50, help="communication rounds R")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the partition, the model init and every round's sampling")
    g.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="several runs that differ in model init and client sampling (the "
                        "partition comes from --seed), vmapped as one compiled program "
                        "(fedjax_pfl.sweep); OUT/seed_S/ per run and mean ± std at the end")
    g.add_argument("--eval-every", type=int, default=1, help="evaluate every k rounds (and the last)")
    g.add_argument("--target-acc", type=float, default=None, metavar="A",
                   help="stop after the first evaluation whose mean client accuracy (acc_mean) is "
                        ">= A, and record that round in summary.json (rounds to accuracy, as in "
                        "FedAvg's tables); default: run all --rounds")
    d = p.add_argument_group("privacy (client-level DP of the uplink: --dp-clip C, "
                             "--dp-noise-multiplier Z among the hyperparameters below)")
    d.add_argument("--dp-delta", type=float, default=None, metavar="D",
                   help="δ at which ε is reported after every round (dp_epsilon in "
                        "metrics.jsonl and summary.json); default N^-1.1")
    d.add_argument("--target-epsilon", type=float, default=None, metavar="E",
                   help="the noise multiplier is computed before the run so that ε after "
                        "--rounds rounds is at most E at --dp-delta (instead of "
                        "--dp-noise-multiplier)")
    d.add_argument("--dp-accountant", default="rdp", choices=("rdp", "pld"),
                   help="dp-accounting's accountant: Rényi DP, or privacy loss distributions "
                        "(pld: with --sampling poisson only, for the summary's final ε; the "
                        "per-round ε stays RDP's; refused with fixed-size sampling)")
    g.add_argument("--eval-clients", default="all",
                   help="clients evaluated at each evaluation: 'all', 'participants' (the round's "
                        "sampled clients) or K (a fixed random subset of K clients); the last round "
                        "always evaluates every client. For large N, evaluation of all clients "
                        "costs more than training")

    g = p.add_argument_group("execution")
    g.add_argument("--rounds-per-call", type=int, default=1,
                   help="K rounds per compiled call (one lax.scan, sampling and metrics on device): "
                        "fewer dispatches for small models; --eval-every must be a multiple of K")
    g.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="storage of per-client float state (bfloat16 halves its memory; "
                        "arithmetic stays float32)")
    g.add_argument("--data-placement", default="auto", choices=("device", "host", "sharded", "auto"),
                   help="where the clients' samples wait between rounds: 'device' (on every "
                        "device), 'host' (in host memory; each round's participants moved to the "
                        "devices, on accelerators the next round's in the background), 'sharded' (each device "
                        "holds its own range of clients, each process reads only its devices' "
                        "ranges; a round's participants' samples move between the devices), "
                        "all with the same results bit for bit; 'auto' (device when the data and "
                        "client state fit in 80%% of the memory, else sharded when a 1/D share "
                        "does, else host)")
    g.add_argument("--state-placement", default="auto", choices=("device", "host", "auto"),
                   help="where the clients' state rows wait between rounds: 'device' (sharded "
                        "over the devices), 'host' (a copy-on-write host store: each call's "
                        "participants' rows moved to the devices and back; clients never "
                        "sampled cost nothing; the same results bit for bit; for algorithms "
                        "that touch only their participants' rows), 'auto' (host when the client "
                        "state would take more than 80%% of the memory and the algorithm allows "
                        "it, else device)")
    g.add_argument("--no-memory-check", action="store_true",
                   help="run even when the memory plan printed at start says it will not fit")
    g.add_argument("--coordinator", default=None,
                   help="multi-process run: HOST:PORT of process 0 (start every process with the "
                        "same flags and its own --process-id; jax.distributed, gloo on CPU)")
    g.add_argument("--distributed", default=None, choices=("auto",),
                   help="multi-process run started by a launcher: 'auto' lets jax.distributed "
                        "read the process layout from SLURM (srun), Open MPI (mpirun), a TPU pod "
                        "or Kubernetes, as for any JAX program (instead of --coordinator)")
    g.add_argument("--num-processes", type=int, default=1, help="multi-process run: process count")
    g.add_argument("--process-id", type=int, default=0, help="multi-process run: this process")
    g.add_argument("--out", default=None,
                   help="output directory (default runs/ALGO_DATASET_TIME); one that holds files is "
                        "refused unless --overwrite or --resume")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run files already in --out (a new run never mixes its files "
                        "with stale ones)")
    g.add_argument("--checkpoint-every", type=int, default=None,
                   help="write the full state to OUT/checkpoints every K rounds and after the last "
                        "(default 10, rounded up to a multiple of --rounds-per-call; 0: never)")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                   help="continue the run in DIR (or --out) from its last checkpoint, with the "
                        "configuration saved there (metrics identical to an uninterrupted run); "
                        "other flags must match it, except --rounds (to extend the run), "
                        "--checkpoint-every, --target-acc, --conv, --log, "
                        "--checkpoint-on-signal, --quiet and --no-memory-check")
    g.add_argument("--checkpoint-on-signal", nargs="?", const="USR1", default=None,
                   metavar="SIGNAL",
                   help="also checkpoint at the next round boundary when SIGNAL arrives (default "
                        "USR1): a scheduler's warning before it stops the job, e.g. SLURM's "
                        "--signal=B:USR1@120. SIGINT and SIGTERM always stop a run cleanly "
                        "(resumable; exit 130 and 143)")
    g.add_argument("--log", default="",
                   help="metric sinks besides metrics.jsonl, comma-separated: tensorboard "
                        "(OUT/tensorboard), mlflow (OUT/mlflow.db unless MLFLOW_TRACKING_URI is set), "
                        "wandb (offline in OUT/wandb unless WANDB_MODE is set); each needs its "
                        "extra: pip install \"fedjax_pfl[tensorboard]\" (or mlflow, wandb, log)")
    g.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (default: on, in "
                        "$FEDJAX_PFL_COMPILE_CACHE, else $JAX_COMPILATION_CACHE_DIR, else "
                        "~/.cache/fedjax_pfl/jax, so a second run of the same configuration "
                        "skips XLA compilation)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--model", default=None,
                   help=f"one of {list(models.MODELS)}; default per dataset (mlp for digits/mnist-"
                        "like, logreg for synthetic, cnn for cifar)")
    g.add_argument("--model-options", default=None, metavar="KEY=VALUE,...",
                   help="sizes of the text models and femnist_cnn, e.g. hidden=64,layers=1 for "
                        "--model char_lstm (models/sequence.py lists each model's options)")
    g.add_argument("--model-cr", type=float, default=2.0,
                   help="compression rate of --model cp_mlp / cp_vgg8: rank round(ΠI/(CR·ΣI)) per "
                        "weight tensor (TDPFed's rule; 1 = the dense model)")
    g.add_argument("--conv", default="auto", choices=models.CONV_IMPLS,
                   help="how convolutions are computed: winograd (F(m, kw) along the width) or "
                        "im2col; auto = winograd for stride-1 convs with kh*C_in >= 8 on CPU, "
                        "im2col elsewhere. The same function up to float rounding; im2col "
                        "reproduces runs made before winograd existed bit for bit")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="digits",
                   help=f"one of {list(sources.DATASETS)}, or a natural-client dataset read from "
                        f"its files in --data-dir: {list(NATURAL_DATASETS)}")
    g.add_argument("--data-dir", default=None,
                   help="directory holding the original dataset files (default $FEDJAX_PFL_DATA_DIR "
                        "or ~/fedjax_pfl_data); for a natural-client dataset, the folder of its "
                        "LEAF train/ and test/ JSON, TFF .h5 or FedJAX .sqlite files (required)")
    g.add_argument("--format", default=None, choices=FORMATS,
                   help="natural-client datasets: the files' format (default: detected from the "
                        "files in --data-dir)")
    g.add_argument("--max-clients", type=int, default=None,
                   help="natural-client datasets: K clients drawn at random (seeded by --seed) "
                        "among those with at least --min-samples training samples (default all)")
    g.add_argument("--min-samples", type=int, default=0,
                   help="natural-client datasets: leave out clients with fewer training samples")
    g.add_argument("--token-accuracy", default=None, choices=("default", "all", "no_oov"),
                   help="per-token tasks: which real targets accuracy scores: default (the "
                        "reader's: all but end of sentence, as FedJAX), all, or no_oov (neither "
                        "end of sentence nor out-of-vocabulary, as TFF's accuracy_without_out_"
                        "of_vocab_or_end_of_sentence); padding never counts")
    g.add_argument("--cache-dir", default=None,
                   help="natural-client datasets: where the converted, client-sorted copy is kept "
                        "(default DATA_DIR/.fedjax_pfl_cache)")
    g.add_argument("--tfds-dir", default=None,
                   help="prepared TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    g.add_argument("--download", action="store_true",
                   help="allow a TFDS download when the dataset is not found locally")
    g.add_argument("--emnist-split", default="balanced", help="EMNIST split (byclass, bymerge, "
                   "balanced, letters, digits, mnist)")
    g.add_argument("--synthetic-alpha", type=float, default=1.0, help="Synthetic(α, β): α")
    g.add_argument("--synthetic-beta", type=float, default=1.0, help="Synthetic(α, β): β")
    g.add_argument("--synthetic-clients", type=int, default=30,
                   help="number of natural clients of the synthetic dataset")
    g.add_argument("--partition", default=None,
                   help=f"one of {list(partition_lib.PARTITIONS)} (default dirichlet; natural for "
                        "synthetic)")
    g.add_argument("--clients", type=int, default=None,
                   help="number of clients N (default 20; synthetic: --synthetic-clients)")
    g.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration α (> 0)")
    g.add_argument("--min-size", type=int, default=10,
                   help="dirichlet: redraw until every client has at least this many samples")
    g.add_argument("--classes-per-client", type=int, default=2, help="pathological: labels per client")
    g.add_argument("--shards-per-client", type=int, default=None, help="shards: shards per client")
    g.add_argument("--shard-size", type=int, default=None, help="shards: samples per shard")
    g.add_argument("--clusters", type=int, default=4,
                   help="clustered: G groups of clients (contiguous ids), each group holding its "
                        "own disjoint set of labels")
    g.add_argument("--test-fraction", type=float, default=0.25,
                   help="fraction of each client's samples held out as its test split")

    g = p.add_argument_group("algorithm (all algorithms; defaults differ per algorithm)")
    seen: set[str] = set()
    # Each flag's default per algorithm that has it, gathered once (per flag it was ~0.2 s a parse).
    table = {name: algorithms.spec(name).all_hparams() for name in algorithms.names()}
    defaults_by_flag: dict[str, dict[str, Any]] = {}
    for name, hparams in table.items():
        for hp, flag in hparams:
            defaults_by_flag.setdefault(flag, {})[name] = hp.default
    for hp in COMMON_HPARAMS:
        _add_hparam(g, hp, hp.cli_flag(None), seen, defaults_by_flag)
    for name, hparams in table.items():
        own = hparams[len(COMMON_HPARAMS):]
        if not own:
            continue
        g = p.add_argument_group(f"{name}")
        for hp, flag in own:
            _add_hparam(g, hp, flag, seen, defaults_by_flag)
    return p


def _add_hparam(group, hp, flag: str, seen: set[str], defaults_by_flag: dict[str, dict[str, Any]]) -> None:
    if flag in seen:
        return
    seen.add(flag)
    per_algo = defaults_by_flag[flag]
    defaults = sorted(set(map(repr, per_algo.values())))
    if len(defaults) == 1:
        default_text = f"default {defaults[0]}"
    else:
        default_text = "defaults: " + ", ".join(f"{k} {v!r}" for k, v in per_algo.items())
    help_text = f"{hp.help} ({default_text})".replace("%", "%%")
    dest = "hp__" + flag.lstrip("-").replace("-", "_")
    if hp.type is bool:
        group.add_argument(flag, *hp.aliases, dest=dest, action="store_true", default=None,
                           help=help_text)
    else:
        group.add_argument(flag, *hp.aliases, dest=dest, default=None, metavar=hp.type.__name__.upper()
                           if hp.choices is None else "{" + ",".join(map(str, hp.choices)) + "}",
                           help=help_text)


def config_from_args(args: argparse.Namespace):
    """The RunConfig the flags describe (raises ValueError naming the flag on bad input)."""
    from fedjax_pfl import algorithms
    from fedjax_pfl.data.build import PartitionConfig
    from fedjax_pfl.data.formats import NATURAL_DATASETS
    from fedjax_pfl.runner import RunConfig

    if args.algo is None:
        if args.preset:
            raise ValueError(f"--preset {args.preset} is a protocol shared by several algorithms: "
                             f"name one with --algo (one of {algorithms.names()})")
        args.algo = "fedavg"
    if args.algo not in algorithms.names():
        raise ValueError(f"--algo must be one of {algorithms.names()}, got {args.algo!r}")
    for key, value in vars(args).items():
        # (--dp-clip inf: clipping off, DP-FedAvg's step without clipping)
        if isinstance(value, float) and not math.isfinite(value) and not (
                key == "dp_clip" and value == math.inf):
            raise ValueError(f"--{key.replace('_', '-')} must be finite, got {value}")
    check_processes(args)
    if args.seeds is not None:
        check_seeds(args.seeds)
        if len(args.seeds) > 1 and args.target_acc is not None:
            raise ValueError("--target-acc stops one run; --seeds runs several as one program "
                             "(run the seeds one by one with --seed to stop each at the target)")
    spec = algorithms.spec(args.algo)
    mine = {flag: hp for hp, flag in spec.all_hparams()}
    hparams = {}
    # A preset's algorithm settings apply where the algorithm has them (a preset shared by
    # pgfed and fedavg sets --pgfed-mu); explicit flags below override them.
    for flag, value in getattr(args, "preset_hparams", {}).items():
        if flag in mine:
            hparams[mine[flag].name] = value
    for key, value in vars(args).items():
        if not key.startswith("hp__") or value is None:
            continue
        flag = "--" + key[4:].replace("_", "-")
        if flag not in mine:
            if key not in getattr(args, "explicit", {key}):   # a saved run's setting (--resume)
                continue
            raise ValueError(f"{flag} does not apply to --algo {args.algo}")
        hparams[mine[flag].name] = value
    synthetic = args.dataset == "synthetic"
    natural = args.dataset in NATURAL_DATASETS
    if natural and args.clients is not None:
        raise ValueError(f"--dataset {args.dataset} keeps its own clients: --clients does not "
                         "apply (use --max-clients K)")
    if not natural:
        for flag, value in (("--format", args.format), ("--max-clients", args.max_clients),
                            ("--cache-dir", args.cache_dir),
                            ("--token-accuracy", args.token_accuracy),
                            ("--min-samples", args.min_samples or None)):
            if value is not None:
                raise ValueError(f"{flag} applies to natural-client datasets "
                                 f"({', '.join(NATURAL_DATASETS)}), not --dataset {args.dataset}")
    scheme = args.partition or ("natural" if synthetic or natural else "dirichlet")
    if args.clients is not None:
        clients = args.clients
    else:
        clients = args.synthetic_clients if synthetic else 20
    partition = PartitionConfig(
        scheme=scheme, num_clients=clients, alpha=args.alpha, min_size=args.min_size,
        classes_per_client=args.classes_per_client, shards_per_client=args.shards_per_client,
        shard_size=args.shard_size, clusters=args.clusters, test_fraction=args.test_fraction, seed=args.seed,
    )
    data_options = {"data_dir": args.data_dir, "tfds_dir": args.tfds_dir, "download": args.download}
    if natural:
        data_options = {"data_dir": args.data_dir, "fmt": args.format, "max_clients": args.max_clients,
                        "min_samples": args.min_samples, "cache_dir": args.cache_dir,
                        "token_accuracy": args.token_accuracy or "default"}
    if args.dataset == "emnist":
        data_options["emnist_split"] = args.emnist_split
    if synthetic:
        data_options.update(synthetic_alpha=args.synthetic_alpha, synthetic_beta=args.synthetic_beta,
                            synthetic_clients=args.synthetic_clients)
    out = args.out or os.path.join("runs", f"{args.algo}_{args.dataset}_{time.strftime('%Y%m%d-%H%M%S')}")
    from fedjax_pfl import sinks
    from fedjax_pfl.interrupts import parse_signal

    log = sinks.parse_log_flag(args.log)
    if args.checkpoint_on_signal is not None:
        parse_signal(args.checkpoint_on_signal)
    return RunConfig(algo=args.algo, dataset=args.dataset, model=args.model,
                     model_options=parse_model_options(args.model_options),
                     model_cr=args.model_cr, model_conv=args.conv, partition=partition,
                     rounds=args.rounds, seed=args.seed, eval_every=args.eval_every,
                     eval_clients=args.eval_clients, rounds_per_call=args.rounds_per_call,
                     state_dtype=args.state_dtype, data_placement=args.data_placement,
                     state_placement=args.state_placement,
                     memory_check=not args.no_memory_check, out=out,
                     hparams=hparams, data_options=data_options, progress=not args.quiet,
                     checkpoint_every=args.checkpoint_every, resume=args.resume is not None,
                     target_acc=args.target_acc, log=log,
                     checkpoint_on_signal=args.checkpoint_on_signal, dp_delta=args.dp_delta,
                     target_epsilon=args.target_epsilon, dp_accountant=args.dp_accountant)


def parse_model_options(text: str | None) -> dict[str, Any]:
    """'hidden=64,output_tanh=true' -> {"hidden": 64, "output_tanh": True} (ints, floats, booleans
    and words)."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"--model-options takes KEY=VALUE pairs separated by commas, got {item!r}")
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


def parse(argv: list[str] | None = None, base_defaults: dict | None = None) -> argparse.Namespace:
    """The flags; `base_defaults` (dest -> value) replace the defaults (a preset and explicit
    flags still win): --resume parses the flags on top of the saved run's configuration."""
    parser = build_parser()
    if base_defaults:
        parser.set_defaults(**base_defaults)
    pre, _ = parser.parse_known_args(argv)
    preset_hparams: dict = {}
    if pre.preset:
        path = CONFIG_DIR / f"{pre.preset}.json"
        if not path.exists():
            _fail(f"--preset {pre.preset!r} not found; available: {_presets()}")
        try:
            preset = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:          # JSONDecodeError, UnicodeDecodeError, …
            _fail(f"preset file {path}: not valid JSON ({' '.join(str(e).split())})")
        if not isinstance(preset, dict):
            _fail(f"preset file {path}: must hold a JSON object of settings, got a JSON "
                  f"{type(preset).__name__}")
        preset.pop("_doc", None)
        dests = {a.dest for a in parser._actions}
        defaults = {}
        for key, value in preset.items():
            if key in dests:
                defaults[key] = value
            elif "hp__" + key in dests:
                preset_hparams["--" + key.replace("_", "-")] = value
            else:
                _fail(f"preset {pre.preset}: unknown setting {key!r}")
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    args.preset_hparams = preset_hparams
    args.explicit = _explicit_dests(argv)
    args.argv = argv
    return args


def _saved_defaults(record: dict) -> dict:
    """argparse defaults (dest -> value) that reproduce a saved config.json record."""
    from fedjax_pfl import algorithms

    part = record["partition"]
    out = {key: record[key] for key in ("algo", "dataset", "model", "model_cr", "rounds", "seed",
                                        "eval_every", "eval_clients", "rounds_per_call",
                                        "state_dtype") if key in record}
    out.update(partition=part["scheme"], clients=part["num_clients"], alpha=part["alpha"],
               min_size=part["min_size"], classes_per_client=part["classes_per_client"],
               shards_per_client=part["shards_per_client"], shard_size=part["shard_size"],
               clusters=part["clusters"], test_fraction=part["test_fraction"])
    out.update({("format" if k == "fmt" else k): v
                for k, v in record.get("data_options", {}).items()})
    if record.get("model_options"):
        out["model_options"] = ",".join(f"{k}={v}" for k, v in record["model_options"].items())
    from fedjax_pfl.data.formats import NATURAL_DATASETS

    if record.get("dataset") in NATURAL_DATASETS:
        out["clients"] = None                 # a natural dataset keeps its own clients
    if "checkpoint_every" in record:
        out["checkpoint_every"] = record["checkpoint_every"]
    if record.get("log"):
        out["log"] = ",".join(record["log"])
    if record.get("checkpoint_on_signal"):
        out["checkpoint_on_signal"] = record["checkpoint_on_signal"]
    # A run saved before --conv existed computed every convolution by im2col.
    out["conv"] = record.get("model_conv", "im2col")
    for hp, flag in algorithms.spec(record["algo"]).all_hparams():
        if hp.name in record.get("hparams", {}):
            out["hp__" + flag.lstrip("-").replace("-", "_")] = record["hparams"][hp.name]
    return out


def _explicit_dests(argv: list[str] | None) -> set[str]:
    """The destinations of the flags given on the command line (not defaults, not a preset)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv)
    return set(vars(given))


class UsageError(ValueError):
    """Bad command-line input: one line naming the flag (what `_fail` reports with status 2)."""


# True inside `parse_flags`: `_fail` raises UsageError instead of printing and exiting.
_RAISE_USAGE_ERRORS = contextvars.ContextVar("raise_usage_errors", default=False)


def parse_flags(argv: list[str]) -> argparse.Namespace:
    """`parse(argv)` for entry points that report errors their own way (experiments/sweep.py's
    --common): a bad flag, value or preset raises UsageError instead of exiting."""
    token = _RAISE_USAGE_ERRORS.set(True)
    try:
        return parse(argv)
    finally:
        _RAISE_USAGE_ERRORS.reset(token)


def check_seeds(seeds: Sequence[int], flag: str = "--seeds") -> None:
    """Each seed an integer in [0, 2**32) and none listed twice (two runs of one seed would share
    one seed_S directory and count twice in the mean ± std). ValueError naming `flag`."""
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"{flag} must be in [0, 2**32), got {seed!r}")
    repeated = sorted({s for s in seeds if list(seeds).count(s) > 1})
    if repeated:
        raise ValueError(f"{flag} lists seed {repeated[0]} more than once; each seed is one run")


def check_processes(args: argparse.Namespace) -> None:
    """--coordinator / --num-processes / --process-id describe one process of a multi-process
    run, or are all left at their defaults. ValueError naming the flag."""
    n, i = args.num_processes, args.process_id
    if n < 1:
        raise ValueError(f"--num-processes must be >= 1, got {n}")
    if not 0 <= i < n:
        raise ValueError(f"--process-id must be in [0, --num-processes {n}), got {i}")
    if getattr(args, "distributed", None) and (args.coordinator is not None or n != 1 or i != 0):
        raise ValueError("--distributed auto takes the process layout from the launcher: give "
                         "neither --coordinator nor --num-processes / --process-id")
    if args.coordinator is None and n != 1:
        raise ValueError(f"--num-processes {n} needs --coordinator HOST:PORT (process 0's address); "
                         "without it the run is a single process")
    if args.coordinator is not None:
        host, sep, port = args.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")


def _fail(message: str, code: int = 2) -> None:
    if code == 2 and _RAISE_USAGE_ERRORS.get():
        raise UsageError(message)
    print(f"run.py: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """The command line; returns the exit status (0, 1 on divergence, 2 on bad input, 130 on
    Ctrl-C, 143 on SIGTERM). Errors before any computation raise SystemExit(2) with one line on
    stderr. `callbacks` (fedjax_pfl.callbacks.Callback) are passed to the run."""
    from fedjax_pfl.interrupts import exit_status, stop_signals

    try:
        with stop_signals():
            return _main(argv, callbacks)
    except KeyboardInterrupt as e:
        _report_interrupt(e)
        return exit_status(e)


def _report_interrupt(e: KeyboardInterrupt) -> None:
    from fedjax_pfl import runner
    from fedjax_pfl.interrupts import signal_name

    how = "terminated (SIGTERM)" if signal_name(e) == "SIGTERM" else "interrupted"
    if isinstance(e, runner.Interrupted) and e.out:
        where = (f"during compilation" if e.phase == "compile" else f"after round {e.last_round}")
        # What is on disk decides (a resume stopped while compiling has loaded no checkpoint yet,
        # but its directory holds them): --resume only where there is something to continue.
        latest = runner.latest_checkpoint(e.out)
        if latest is None:
            print(f"run.py: {how} {where}; {e.out} records what finished (no checkpoint yet: "
                  f"nothing to resume; start it again with --overwrite)", file=sys.stderr,
                  flush=True)
            return
        ckpt = (f"last checkpoint: round {e.checkpoint_round}" if e.checkpoint_round is not None
                else f"last checkpoint: {os.path.basename(latest)}")
        print(f"run.py: {how} {where}; {e.out} records what finished ({ckpt}); continue "
              f"with: python experiments/run.py --resume {e.out}", file=sys.stderr, flush=True)
    else:
        print(f"run.py: {how} before the run started; nothing was written", file=sys.stderr,
              flush=True)


def _resume_config(args, runner):
    """--resume: the RunConfig of the run in the directory, with the flags that may change."""
    out = args.resume or args.out
    if not out:
        raise ValueError("--resume needs the run's directory: --resume DIR (or --out DIR)")
    if args.resume and args.out and os.path.abspath(args.resume) != os.path.abspath(args.out):
        raise ValueError(f"--resume {args.resume} and --out {args.out} name different directories")
    if args.seeds and len(args.seeds) > 1:
        raise ValueError("--resume does not apply to --seeds runs")
    if args.overwrite:
        raise ValueError("--resume continues the run in --out; --overwrite would replace it")
    args.out = out
    runner.check_out(out, resume=True)
    runner.require_checkpoint(out)          # (before the data loads: nothing to continue)
    saved = runner.read_config(out)
    # Flags on top of the saved configuration: those given must agree with it (checked below).
    cfg = config_from_args(parse(args.argv, base_defaults=_saved_defaults(saved)))
    cfg.out, cfg.resume = out, True
    cfg.progress = not args.quiet
    cfg.memory_check = not args.no_memory_check
    conflict = runner.resume_conflicts(cfg, cfg.validate(), runner.model_name_of(cfg), saved)
    if conflict:
        raise ValueError(conflict)
    return cfg


def _main(argv: list[str] | None, callbacks: Sequence[Any] = ()) -> int:
    # Signals wait while JAX and the package are imported (a KeyboardInterrupt inside a C
    # extension's initialisation surfaces as an ImportError traceback); fedjax_pfl.interrupts
    # imports only the standard library.
    from fedjax_pfl.interrupts import deferred_signals

    with deferred_signals():
        import fedjax_pfl

        args = parse(argv)
        try:
            check_processes(args)                # before jax.distributed starts
        except ValueError as e:
            _fail(str(e))
        if args.coordinator or args.distributed:
            if args.distributed:
                fedjax_pfl.init_distributed()
            else:
                fedjax_pfl.init_distributed(args.coordinator, args.num_processes, args.process_id)
            import jax

            if jax.process_index() != 0:     # one voice: only process 0 prints (errors still do)
                sys.stdout.flush()               # fd 1 too: gloo's own lines come from C++
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        else:
            fedjax_pfl.use_cpu_cores()  # before JAX starts: one XLA device per core (not on GPU)
        if args.no_compile_cache:
            import jax

            jax.config.update("jax_enable_compilation_cache", False)   # $JAX_COMPILATION_CACHE_DIR too
        else:
            fedjax_pfl.use_compile_cache()
        from fedjax_pfl import core, runner
        from fedjax_pfl.checkpoint import CheckpointError
        from fedjax_pfl.data.sources import DatasetNotFoundError
        import orbax.checkpoint  # noqa: F401  (imported here, not in the middle of a run)

    with runner.interruptible():
        try:
            if args.resume is not None:
                cfg = _resume_config(args, runner)
            else:
                cfg = config_from_args(args)
                cfg.validate()
                runner.check_out(cfg.out, overwrite=args.overwrite)
            data, info = runner.compute(runner.load_data, cfg)
            prepared = runner.compute(runner.prepare, cfg, data, info)   # the algorithm's checks
        except DatasetNotFoundError as e:
            # One line, but keep everything the message says (where we looked, what to put where).
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            _fail(f"--dataset {cfg.dataset}: {lines[0]} " + "; ".join(lines[1:]))
        except ValueError as e:
            _fail(" ".join(str(e).split()))
        n = info["num_clients"]
        print(f"{cfg.algo} on {cfg.dataset}: {n} client{'' if n == 1 else 's'} "
              f"({info['train_size']['total']} train / {info['test_size']['total']} test samples), "
              f"output in {cfg.out}", flush=True)
        if args.seeds and len(args.seeds) > 1:
            import jax

            if jax.process_index() == 0:
                runner.clear_out(cfg.out)
            return _run_seeds(cfg, args.seeds, data, info)
        try:
            summary = runner.run(cfg, prepared=prepared, log=lambda s: print(s, flush=True),
                                 callbacks=callbacks)
        except runner.NonFiniteError as e:
            _fail(str(e), code=1)
        except (core.MemoryPlanError, runner.ResumeError, CheckpointError) as e:
            _fail(" ".join(str(e).split()))
    best, last = summary["best"], summary["last"]
    print(f"done in {summary['wall_time_s']:.1f}s (compile {summary['compile_time_s']:.1f}s, "
          f"{summary['time_per_round_s'] * 1e3:.1f} ms/round, "
          f"{summary['client_steps_per_s']:.0f} client-steps/s)")
    for key in ("acc_mean", "acc_weighted", "acc_worst10", "global_acc_mean", "participant_best_mean"):
        if key in last:
            print(f"  {key:<22} last {last[key]:.4f}   best {best[key]:.4f} "
                  f"(round {summary['best_round'][key]})")
    if "target" in summary:
        target = summary["target"]
        print(f"  acc_mean >= {target['acc_mean']:g}: " + (f"reached at round {target['round']}"
              if target["round"] is not None else f"not reached in {summary['rounds']} rounds"))
    for key, value in summary.get("communication", {}).items():
        if key.endswith("_total"):
            print(f"  {key:<32} {value:,.0f}")
    return 0


def _run_seeds(cfg, seeds, data, info) -> int:
    """--seeds: one vmapped program over the seeds; per-seed directories and mean ± std."""
    import numpy as np

    from fedjax_pfl import runner, sweep

    runs = [sweep.RunSpec(s) for s in seeds]
    try:
        summaries = sweep.run_group(cfg, runs, data=data, data_info=info, out=cfg.out,
                                    progress=cfg.progress)
    except runner.NonFiniteError as e:
        _fail(str(e), code=1)
    except (ValueError, TypeError) as e:
        _fail(f"--seeds: {' '.join(str(e).split())}")
    keys = ("acc_mean", "acc_weighted", "acc_worst10", "global_acc_mean")
    aggregate = {"seeds": list(seeds), "runs": [s["seed"] for s in summaries]}
    for kind in ("best", "last"):
        for key in keys:
            values = [s[kind][key] for s in summaries if key in s[kind]]
            if values:
                aggregate[f"{kind}_{key}"] = {"mean": float(np.mean(values)),
                                              "std": float(np.std(values)), "values": values}
    import jax

    if jax.process_index() == 0:                  # a multi-process run: process 0 writes
        runner.write_json(os.path.join(cfg.out, "summary.json"), aggregate)
    print(f"{len(seeds)} seeds in one program, {summaries[0]['group_wall_time_s']:.1f}s")
    for key in keys:
        if f"last_{key}" in aggregate:
            last, best = aggregate[f"last_{key}"], aggregate[f"best_{key}"]
            print(f"  {key:<22} last {last['mean']:.4f} ± {last['std']:.4f}   "
                  f"best {best['mean']:.4f} ± {best['std']:.4f}")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except KeyboardInterrupt:            # Ctrl-C while Python starts up (imports)
        print("run.py: interrupted before the run started; nothing was written", file=sys.stderr)
        status = 130
    sys.stdout.flush()
    sys.stderr.flush()
    # After Ctrl-C a worker thread may still be inside XLA: leave without interpreter teardown
    # (tearing down around it is what used to end in a segfault, exit -11).
    os._exit(status) if status in (130, 143) else sys.exit(status)
