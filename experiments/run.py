#!/usr/bin/env python
"""Command line: flags -> validated RunConfig -> fedjax_pfl.runner.run. No math here.

    python experiments/run.py --algo fedavg                       # embedded digits, 20 clients
    python experiments/run.py --algo pgfedmo --rounds 100
    python experiments/run.py --preset pgfed_paper --dataset fashion_mnist --algo pgfed
    python experiments/run.py --resume runs/pgfed_digits_20260101-120000   # after Ctrl-C / a crash

Every algorithm's hyperparameters are flags (`--help` lists them with their defaults per
algorithm). Bad input exits with status 2 and a one-line message naming the flag, before any
computation; so does a flag the run would not use (a partition's, dataset's, model's or
algorithm's setting under another; where the data live is only warned about, in one line, and
left out of config.json). Ctrl-C ends a run with status 130, leaving its record (metrics, an interrupted
summary, the last checkpoint) in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import functools
import json
import logging
import math
import os
import sys
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
    from fedjax_pfl import algorithms, models
    from fedjax_pfl.algorithms import COMMON_HPARAMS
    from fedjax_pfl.data import partition as partition_lib
    from fedjax_pfl.data import sources
    from fedjax_pfl.data.formats import FORMATS, NATURAL_DATASETS
    from fedjax_pfl.runner.options import DEFAULTS as D

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
    g.add_argument("--rounds", type=int, default=D["rounds"], help="communication rounds R")
    g.add_argument("--seed", type=int, default=D["seed"],
                   help="seeds the partition, the model init and every round's sampling")
    g.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="several runs that differ in model init and client sampling (the "
                        "partition comes from --seed), vmapped as one compiled program "
                        "(fedjax_pfl.sweep); OUT/seed_S/ per run and mean ± std at the end")
    g.add_argument("--eval-every", type=int, default=D["eval_every"],
                   help="evaluate every k rounds (and the last)")
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
                        "--dp-noise-multiplier); warned when that z exceeds the clients a round "
                        "(noise on the mean update above the clip: no learning) or ε lands on "
                        "the accountant's precision floor instead of the target")
    d.add_argument("--dp-accountant", default=D["dp_accountant"], choices=("rdp", "pld"),
                   help="dp-accounting's accountant: Rényi DP, or privacy loss distributions "
                        "(pld: with --sampling poisson only, for the summary's final ε; the "
                        "per-round ε stays RDP's; refused with fixed-size sampling)")
    g.add_argument("--eval-clients", default=D["eval_clients"],
                   help="clients evaluated at each evaluation: 'all', 'participants' (the round's "
                        "sampled clients) or K (a fixed random subset of K clients); the last round "
                        "always evaluates every client. For large N, evaluation of all clients "
                        "costs more than training")
    g.add_argument("--unseen-clients", type=float, default=D["unseen_clients"], metavar="FRAC",
                   help="hold out ceil(FRAC*N) clients, drawn once from --seed, from every "
                        "round's sampling (pFL-Bench's unseen clients): they never train and are "
                        "evaluated as newcomers by the algorithm's own rule "
                        "(docs/algorithms/NAME.md); the summary gives acc_mean_seen, "
                        "acc_mean_unseen and participation_gap. In [0, 1); refused where fewer "
                        "than a round's clients would be left")

    g.add_argument("--attack-seed", type=int, default=D["attack_seed"], metavar="S",
                   help="the seed that draws the malicious clients (--attack-fraction; "
                        "docs/attacks.md); default: --seed")

    g = p.add_argument_group("execution")
    g.add_argument("--rounds-per-call", type=int, default=D["rounds_per_call"],
                   help="K rounds per compiled call (one lax.scan, sampling and metrics on device): "
                        "fewer dispatches for small models; --eval-every must be a multiple of K")
    g.add_argument("--state-dtype", default=D["state_dtype"], choices=("float32", "bfloat16"),
                   help="storage of per-client float state (bfloat16 halves its memory; "
                        "arithmetic stays float32)")
    g.add_argument("--data-placement", default=D["data_placement"],
                   choices=("device", "host", "sharded", "auto"),
                   help="where the clients' samples wait between rounds: 'device' (on every "
                        "device), 'host' (in host memory; each round's participants moved to the "
                        "devices, on accelerators the next round's in the background), 'sharded' (each device "
                        "holds its own range of clients, each process reads only its devices' "
                        "ranges; a round's participants' samples move between the devices), "
                        "all with the same results bit for bit; 'auto' (device when the data and "
                        "client state fit in 80%% of the memory, else sharded when a 1/D share "
                        "does, else host)")
    g.add_argument("--state-placement", default=D["state_placement"],
                   choices=("device", "host", "auto"),
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
    g.add_argument("--coordinator-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="multi-process run: how long the processes wait for each other at start "
                        "(then one line and exit 2; SIGINT/SIGTERM end the wait at once)")
    g.add_argument("--peer-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="multi-process run: a process silent this long is lost; the others stop "
                        "as after SIGTERM (summary.json marked interrupted, the last checkpoint "
                        "resumable) and exit 75")
    g.add_argument("--out", default=None,
                   help="output directory (default runs/ALGO_DATASET_TIME); one that holds files is "
                        "refused unless --overwrite or --resume")
    g.add_argument("--export", action="store_true",
                   help="after the last round write the final server model and the personal "
                        "models to OUT/final/ (global.safetensors, personal.safetensors, "
                        "model.json; fedjax_pfl.export.load reads them back); needs --out")
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
    g.add_argument("--log", default=D["log"],
                   help="metric sinks besides metrics.jsonl, comma-separated: tensorboard "
                        "(OUT/tensorboard), mlflow (OUT/mlflow.db unless MLFLOW_TRACKING_URI is set), "
                        "wandb (offline in OUT/wandb unless WANDB_MODE is set); each needs its "
                        "extra: pip install \"fedjax_pfl[tensorboard]\" (or mlflow, wandb, log)")
    g.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (default: on, in "
                        "$FEDJAX_PFL_COMPILE_CACHE, else $JAX_COMPILATION_CACHE_DIR, else "
                        "~/.cache/fedjax_pfl/jax, so a second run of the same configuration "
                        "skips XLA compilation; $FEDJAX_PFL_COMPILE_CACHE=off turns it off too; "
                        "a directory that cannot be written: one warning, no cache). The "
                        "summary says how many programs came from the cache")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bar, and no lines of the metric sinks' own libraries (W&B)")
    g.add_argument("--model", default=None,
                   help=f"one of {list(models.MODELS)}, or hf:PATH (a pretrained decoder in a "
                        "local Hugging Face folder, docs/pretrained.md); default per dataset (mlp for digits/mnist-"
                        "like, logreg for synthetic, cnn for cifar)")
    g.add_argument("--model-options", default=None, metavar="KEY=VALUE,...",
                   help="sizes of the text models and femnist_cnn, e.g. hidden=64,layers=1 for "
                        "--model char_lstm (models/sequence.py lists each model's options)")
    g.add_argument("--model-dtype", default=None, choices=("float32", "bfloat16"),
                   help="--model hf:PATH: the base weights' dtype (default float32)")
    g.add_argument("--peft", default=None, choices=("lora",),
                   help="train LoRA adapters over the frozen model (pretrained or ours) instead "
                        "of every weight: the adapters are the state the algorithm keeps, "
                        "averages and personalises (docs/adapters.md)")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="--peft lora: the adapters' rank r (default 8)")
    g.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help="--peft lora: the scale numerator α, the update is (α/r)·BA (default 16)")
    g.add_argument("--lora-targets", default=None, metavar="NAME,...",
                   help="--peft lora: the dense modules adapted, names or paths (PEFT's "
                        "target_modules), or all (default q_proj,v_proj)")
    g.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                   help="--peft lora: dropout on the adapters' input in training (default 0)")
    g.add_argument("--model-cr", type=float, default=D["model_cr"],
                   help="compression rate of --model cp_mlp / cp_vgg8: rank round(ΠI/(CR·ΣI)) per "
                        "weight tensor (TDPFed's rule; 1 = the dense model)")
    g.add_argument("--conv", default=D["conv"], choices=models.CONV_IMPLS,
                   help="how convolutions are computed: winograd (F(m, kw) along the width) or "
                        "im2col; auto = winograd for stride-1 convs with kh*C_in >= 8 on CPU, "
                        "im2col elsewhere. The same function up to float rounding; im2col "
                        "reproduces runs made before winograd existed bit for bit")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=D["dataset"],
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
    g.add_argument("--min-samples", type=int, default=D["min_samples"],
                   help="natural-client datasets: leave out clients with fewer training samples")
    g.add_argument("--max-client-samples", type=int, default=None,
                   help="natural-client datasets: each client's first K training samples, in "
                        "the files' order (TFF's max_elements_per_user; default all)")
    g.add_argument("--token-accuracy", default=None, choices=("default", "all", "no_oov"),
                   help="per-token tasks: which real targets accuracy scores: default (the "
                        "reader's: all but end of sentence, as FedJAX), all, or no_oov (neither "
                        "end of sentence nor out-of-vocabulary, as TFF's accuracy_without_out_"
                        "of_vocab_or_end_of_sentence); padding never counts")
    g.add_argument("--quantise", default=None, choices=("round", "refuse"),
                   help="natural-client datasets: values the converted copy cannot store exactly "
                        "(grey levels off the k/255 grid): round (the default) stores the nearest "
                        "level and reports the count, refuse stops with an error")
    g.add_argument("--cache-dir", default=None,
                   help="natural-client datasets: where the converted, client-sorted copy is kept "
                        "(default DATA_DIR/.fedjax_pfl_cache)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="--dataset jsonl (required), shakespeare and stackoverflow_nwp (TFF or "
                        "FedJAX files): the pretrained tokenizer, a tokenizer.json or the folder "
                        "holding one (Hugging Face layout); tokens and labels as "
                        "docs/text-finetuning-data.md says")
    g.add_argument("--client-field", default=None, metavar="NAME",
                   help="--dataset jsonl: the record field naming its client (default client)")
    g.add_argument("--text-field", default=None, metavar="NAME",
                   help="--dataset jsonl: the record field of the text, all of it scored "
                        "(default text)")
    g.add_argument("--instruction-field", default=None, metavar="NAME",
                   help="--dataset jsonl: with --response-field, instruction mode: the prompt "
                        "(--prompt-template filled with this field) is not scored, the response is")
    g.add_argument("--response-field", default=None, metavar="NAME",
                   help="--dataset jsonl: the record field of the response (instruction mode)")
    g.add_argument("--prompt-template", default=None, metavar="TEMPLATE",
                   help="--dataset jsonl, instruction mode: a str.format template of the prompt, "
                        "{instruction} the instruction field, any other {name} the record's "
                        "field (default '### Instruction:\\n{instruction}\\n\\n### "
                        "Response:\\n')")
    g.add_argument("--max-length", type=int, default=None, metavar="T",
                   help="--dataset jsonl: tokens per example (default 128): its first T + 1 "
                        "tokens are kept, T inputs each with its next token as target")
    g.add_argument("--tfds-dir", default=None,
                   help="prepared TFDS data dir (default $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    g.add_argument("--download", action="store_true",
                   help="allow a TFDS download when the dataset is not found locally")
    g.add_argument("--emnist-split", default=D["emnist_split"],
                   help="EMNIST split (byclass, bymerge, balanced, letters, digits, mnist)")
    g.add_argument("--synthetic-alpha", type=float, default=D["synthetic_alpha"],
                   help="Synthetic(α, β): α")
    g.add_argument("--synthetic-beta", type=float, default=D["synthetic_beta"],
                   help="Synthetic(α, β): β")
    g.add_argument("--synthetic-clients", type=int, default=D["synthetic_clients"],
                   help="number of natural clients of the synthetic dataset")
    g.add_argument("--partition", default=None,
                   help=f"one of {list(partition_lib.PARTITIONS)} (default dirichlet; natural for "
                        "synthetic)")
    g.add_argument("--clients", type=int, default=None,
                   help="number of clients N (default 20; synthetic: --synthetic-clients)")
    g.add_argument("--alpha", type=float, default=D["alpha"],
                   help="Dirichlet concentration α (> 0)")
    g.add_argument("--min-size", type=int, default=D["min_size"],
                   help="dirichlet: redraw until every client has at least this many samples")
    g.add_argument("--classes-per-client", type=int, default=D["classes_per_client"],
                   help="pathological: labels per client")
    g.add_argument("--shards-per-client", type=int, default=None, help="shards: shards per client")
    g.add_argument("--shard-size", type=int, default=None, help="shards: samples per shard")
    g.add_argument("--clusters", type=int, default=D["clusters"],
                   help="clustered: G groups of clients (contiguous ids), each group holding its "
                        "own disjoint set of labels")
    g.add_argument("--test-fraction", type=float, default=D["test_fraction"],
                   help="fraction of each client's samples held out as its test split (--dataset "
                        "jsonl: each client's last ones)")

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


# The dests of run.py's own flags, not options of RunConfig.from_options: a multi-process run's
# layout, the seeds of a vmapped group, presets, what may happen to --out, the compile cache.
CLI_ONLY = ("preset", "seeds", "coordinator", "distributed", "num_processes", "process_id",
            "coordinator_timeout", "peer_timeout", "overwrite", "no_compile_cache", "export")


def config_from_args(args: argparse.Namespace, prog: str = "run.py", *,
                     say_harmless: bool = True, **given: Any):
    """The RunConfig the flags describe (raises ValueError naming the flag on bad input):
    `RunConfig.from_options` of `run_options(args, **given)`, each option it leaves out (a
    harmless flag the run does not use, or a preset's) said in one line on stderr,
    "PROG: warning: …"; the harmless ones silently with `say_harmless` False (sweep.py's
    --common over several datasets: --data-dir serves the ones that read files)."""
    from fedjax_pfl.runner import RunConfig

    values = run_options(args, **given)
    with said_warnings(prog, values["algo"], say_harmless=say_harmless):
        cfg = RunConfig.from_options(**values)
    cfg.compile_cache = not getattr(args, "no_compile_cache", False)   # (a flag of run.py's own)
    return cfg


# The warning lines of the outermost `said_warnings` block, said once it has succeeded.
_PENDING: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("pending_warnings",
                                                                            default=None)


@contextlib.contextmanager
def said_warnings(prog: str = "run.py", algo: Any = None, *, say_harmless: bool = True):
    """The library's OptionWarnings inside the block (an option left out, a --target-epsilon
    that cannot serve a useful run, a clamped compression rate) said one line each on stderr,
    "PROG: warning: …" with the flags' spellings (of `algo`'s, or `algo()`'s when it is
    callable), once the outermost such block has succeeded: a block that fails says only its
    error, in its one line. The harmless ones silently with `say_harmless` False."""
    import warnings

    from fedjax_pfl.errors import OptionWarning

    outer = _PENDING.get()
    pending: list[str] = outer if outer is not None else []
    token = _PENDING.set(pending) if outer is None else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OptionWarning)
            yield
    finally:
        if token is not None:
            _PENDING.reset(token)
    spell_algo = algo() if callable(algo) else algo
    for w in caught:
        if isinstance(w.message, OptionWarning):
            if not (w.message.harmless and not say_harmless):
                pending.append(f"{prog}: warning: {message(w.message, spell_algo)}")
        else:                                   # (not ours: as Python would show it)
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if outer is None:
        for line in pending:
            print(line, file=sys.stderr, flush=True)


def run_options(args: argparse.Namespace, **given: Any) -> dict[str, Any]:
    """`RunConfig.from_options`'s keywords from the parsed flags (the options are the dests):
    the options given on the command line or by a --preset (the others are the library's
    defaults, which are the flags'), `given` on top (sweep.py: each run's algo and dataset); the
    hyperparameter flags by the algorithm's names (a preset's where the algorithm has them,
    explicit flags over them); `preset`: what the preset set and nothing on the command line
    overrode (left out with a warning where the run does not use it). The command line's own
    checks made (--preset without --algo, the process layout, --seeds, a flag of another
    algorithm)."""
    from fedjax_pfl import algorithms
    from fedjax_pfl.runner import options

    explicit = set(getattr(args, "explicit", set(options.DEFAULTS)))
    from_preset = set(getattr(args, "preset_settings", set())) - explicit
    values = {dest: getattr(args, dest) for dest in options.DEFAULTS
              if dest in explicit | from_preset | {"algo", "out"}}
    values["resume"] = args.resume is not None
    values.update(given)
    values["hparams"] = _checked_hparams(args, values, preset=True)
    flags = {flag: hp.name for hp, flag in algorithms.spec(values["algo"]).all_hparams()}
    explicit_flags = {"--" + d[4:].replace("_", "-") for d in explicit if d.startswith("hp__")}
    values["preset"] = ({(dest, "") for dest in from_preset - set(given)}
                        | {(flags[f], "hparams") for f in getattr(args, "preset_hparams", {})
                           if f in flags and f not in explicit_flags})
    return values


def _checked_hparams(args: argparse.Namespace, values: dict[str, Any], *, preset: bool) -> dict:
    """The checks `RunConfig.from_options` cannot make (the flags run.py has of its own), in the
    order the command line reports them, then the hyperparameter flags by name for
    values["algo"] (set to fedavg when neither --algo nor a preset names one)."""
    from fedjax_pfl import algorithms, sweep
    from fedjax_pfl.runner import options

    if values["algo"] is None:
        if args.preset:
            raise ValueError(f"--preset {args.preset} is a protocol shared by several algorithms: "
                             f"name one with --algo (one of {algorithms.names()})")
        values["algo"] = "fedavg"
    options.check_algo(values["algo"])
    options.check_finite(values)
    check_processes(args)
    if args.seeds is not None:
        sweep.check_seeds(args.seeds, target_acc=values.get("target_acc"))
    if args.seeds and len(args.seeds) > 1 and values.get("unseen_clients"):
        # (the sweep's stacked runs would each need their own held-out set: not built yet)
        raise ValueError("--unseen-clients applies to one run, not to --seeds runs")
    if getattr(args, "export", False):        # (run.py's own: RunConfig.export)
        if args.out is None and args.resume in (None, ""):
            raise ValueError("--export writes OUT/final/: it needs --out DIR")
        if args.seeds and len(args.seeds) > 1:
            raise ValueError("--export applies to one run, not to --seeds runs")
    mine = {flag: hp for hp, flag in algorithms.spec(values["algo"]).all_hparams()}
    hparams = {}
    # A preset's algorithm settings apply where the algorithm has them (a preset shared by
    # pgfed and fedavg sets --pgfed-mu); explicit flags below override them.
    for flag, value in (getattr(args, "preset_hparams", {}).items() if preset else ()):
        if flag in mine:
            hparams[mine[flag].name] = _typed(mine[flag], value)
    for key, value in vars(args).items():
        if not key.startswith("hp__") or value is None:
            continue
        flag = "--" + key[4:].replace("_", "-")
        if flag not in mine:
            raise ValueError(f"{flag} does not apply to --algo {values['algo']}")
        hparams[mine[flag].name] = _typed(mine[flag], value)
    return hparams


def _typed(hp, value):
    """A flag's text as the hyperparameter's type where it converts (`--lr 0.1` -> 0.1, what a
    notebook passes); as it is otherwise, for `RunConfig.validate` to refuse in its words."""
    if hp.type is bool or isinstance(value, hp.type):
        return value
    try:
        return hp.type(value)
    except (TypeError, ValueError):
        return value


@functools.lru_cache(maxsize=None)
def _flags() -> dict[str, str]:
    """dest -> flag of every option."""
    return {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}


def spelling(algo: str | None = None):
    """(name, space) -> this command line's flag for an argument the library's errors name
    (`fedjax_pfl.errors.arg`): RunConfig's fields, PartitionConfig's and the data options by the
    option that sets them (`runner.options.option_name`), the run's own names by their dest, the
    hyperparameters of `algo` by its flags; None (said plainly) for a name without a flag."""
    from fedjax_pfl import algorithms
    from fedjax_pfl.runner import options

    flags = _flags()
    # (before the algorithm is known, the common hyperparameters by their flags)
    hparams = {hp.name: flag for hp, flag in algorithms.spec(
        algo if algo in algorithms.names() else "fedavg").all_hparams()}

    def spell(name: str, space: str) -> str | None:
        if space == "hparams":
            return hparams.get(name)
        option = options.option_name(name, space)
        return flags.get(option if option is not None else name if space == "" else None)
    return spell


def message(e: BaseException, algo: str | None = None) -> str:
    """What run.py says for an error: the library's argument names as its flags (with `algo`'s
    hyperparameter flags), one line."""
    from fedjax_pfl.errors import spelled

    return " ".join(spelled(e, spelling(algo)).split())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, a preset's settings as their defaults (explicit flags win); `preset_hparams`
    holds the preset's hyperparameters by flag, `preset_settings` the dests it sets, `explicit`
    the dests given on the command line."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    preset_hparams: dict = {}
    defaults: dict = {}
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
        rows = preset.pop("rows", None)
        if rows is not None:
            preset.update(preset_row(pre.preset, rows, pre.hp__server_opt or
                                     preset.get("server_opt") or "sgd"))
        by_algo = preset.pop("algos", None)
        if by_algo is not None:
            preset.update(preset_algo(pre.preset, by_algo, pre.algo or preset.get("algo")))
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
    args.preset_settings = set(defaults)
    args.explicit = _explicit_dests(argv)
    args.argv = argv
    return args


def preset_row(name: str, rows: Any, server_opt: str) -> dict[str, Any]:
    """The settings of a preset's row for `server_opt` (--server-opt's value, else the preset's
    own, else sgd): a preset shared by several server optimisers (Reddi et al. 2021's FedAvg,
    FedAvgM, FedAdagrad, FedAdam and FedYogi rows, each with its own client and server learning
    rates) keeps each row's settings under "rows", keyed by --server-opt. They are preset
    settings like the others (explicit flags still win); a row the preset does not have is
    refused in one line naming those it has, since its learning rates were never tuned."""
    if not isinstance(rows, dict) or not all(isinstance(r, dict) for r in rows.values()):
        _fail(f"preset {name}: \"rows\" must map each --server-opt to a JSON object of settings")
    if server_opt not in rows:
        _fail(f"preset {name} has no row for --server-opt {server_opt}: its rows are "
              f"{sorted(rows)}")
    return {k: v for k, v in rows[server_opt].items() if k != "_doc"}


def preset_algo(name: str, by_algo: Any, algo: str | None) -> dict[str, Any]:
    """The settings a preset gives one algorithm beyond its common ones ("algos", keyed by
    --algo: PFLlib's FedRep trains its head for 1 epoch and its body for 1 more, our
    --local-epochs 2 --fedrep-head-epochs 1); none for an algorithm it does not name. Preset
    settings like the others: explicit flags still win."""
    if not isinstance(by_algo, dict) or not all(isinstance(r, dict) for r in by_algo.values()):
        _fail(f"preset {name}: \"algos\" must map each --algo to a JSON object of settings")
    return {k: v for k, v in by_algo.get(algo or "", {}).items() if k != "_doc"}


def parse_on_top(argv: list[str], base: argparse.Namespace) -> argparse.Namespace:
    """`argv` parsed as if it followed the flags `base` was parsed from (compare.py: a run's
    flags after --common): its explicit flags win, then `base`'s; its preset, if it names one,
    replaces `base`'s (the last --preset is the one that counts)."""
    top = parse(argv)
    merged = argparse.Namespace(**vars(base))
    own_preset = "preset" in top.explicit
    for dest, value in vars(top).items():
        if dest in ("preset_hparams", "preset_settings", "explicit", "argv"):
            continue
        if dest in top.explicit or (own_preset and dest not in base.explicit):
            setattr(merged, dest, value)
    if own_preset:
        merged.preset_hparams, merged.preset_settings = top.preset_hparams, top.preset_settings
    merged.explicit = base.explicit | top.explicit
    merged.argv = [*(base.argv or []), *argv]
    return merged


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


def parse_flags(argv: list[str], on_top_of: argparse.Namespace | None = None
                ) -> argparse.Namespace:
    """`parse(argv)` (`parse_on_top(argv, on_top_of)` with a base) for entry points that report
    errors their own way (experiments/sweep.py's --common, compare.py's runs): a bad flag, value
    or preset raises UsageError instead of exiting."""
    token = _RAISE_USAGE_ERRORS.set(True)
    try:
        return parse(argv) if on_top_of is None else parse_on_top(argv, on_top_of)
    finally:
        _RAISE_USAGE_ERRORS.reset(token)


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
    multi = args.coordinator is not None or getattr(args, "distributed", None)
    for dest in ("coordinator_timeout", "peer_timeout"):
        flag = "--" + dest.replace("_", "-")
        value = getattr(args, dest, None)
        if value is None:
            continue
        if not multi and dest in getattr(args, "explicit", ()):
            raise ValueError(f"{flag} applies to a multi-process run (--coordinator or "
                             "--distributed): a single process waits for no one")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a number of seconds > 0, got {value}")
    if args.coordinator is not None:
        host, sep, port = args.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")


def start_processes(args: argparse.Namespace, tool: str = "run.py") -> None:
    """A multi-process run's start (`fedjax_pfl.init_distributed`): every process's flags but
    --process-id must agree; one line and exit 2 when they do not or the others do not come.
    Afterwards only process 0 prints to stdout (errors, on stderr, still name their process)."""
    import fedjax_pfl
    from fedjax_pfl.distributed import StartupError
    from fedjax_pfl.interrupts import signals_taken

    flags = {k: v for k, v in vars(args).items() if k not in ("process_id", "explicit",
                                                                "preset_settings")}
    layout = ((None, None, None) if args.distributed
              else (args.coordinator, args.num_processes, args.process_id))
    try:
        with signals_taken():                # (inside the start-up's deferred signals)
            fedjax_pfl.init_distributed(*layout, timeout=args.coordinator_timeout,
                                        peer_timeout=args.peer_timeout, facts={"flags": flags})
    except StartupError as e:
        _fail(message(e), prefix=tool)
    import jax

    if jax.process_index() != 0:         # one voice: only process 0 prints (errors still do)
        sys.stdout.flush()                   # fd 1 too: gloo's own lines come from C++
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _fail(message: str, code: int = 2, prefix: str = "run.py") -> None:
    if code == 2 and _RAISE_USAGE_ERRORS.get():
        raise UsageError(message)
    print(f"{prefix}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """The command line; returns the exit status (0, 1 on divergence, 2 on bad input, 75 when
    a process of a multi-process run was lost, 130 on Ctrl-C, 143 on SIGTERM). Errors before
    any computation raise SystemExit(2) with one line on stderr. `callbacks`
    (fedjax_pfl.callbacks.Callback) are passed to the run."""
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

    name = signal_name(e)
    how = ("terminated (SIGTERM)" if name == "SIGTERM" else "interrupted" if name == "SIGINT"
           else f"stopped: {name}" + (f" ({e.reason})" if getattr(e, "reason", None) else ""))
    if name.startswith("lost") and isinstance(e, runner.Interrupted):
        from fedjax_pfl import distributed

        loss = distributed.lost()
        if loss is not None:
            how = f"stopped: {loss}"
    if isinstance(e, runner.Interrupted) and not e.out:        # a process that does not write
        import jax

        where = "during compilation" if e.phase == "compile" else f"after round {e.last_round}"
        print(f"run.py: process {jax.process_index()}: {how} {where}; process 0 records the run",
              file=sys.stderr, flush=True)
        return
    if isinstance(e, runner.Interrupted) and e.out:
        where = ("during compilation" if e.phase == "compile" else f"after round {e.last_round}")
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
    """--resume: `runner.resume_config` of the run in the directory, with the flags given on the
    command line (or in a --preset) on top; they must agree with the saved run, except those a
    resume may change."""
    from fedjax_pfl.runner import options

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
    saved = runner.saved_options(out)       # (before the data loads: nothing to continue)
    given = {dest: getattr(args, dest) for dest in options.DEFAULTS
             if dest in args.explicit | args.preset_settings and dest not in ("out", "resume")}
    values = {**options.DEFAULTS, **saved, **given}
    del values["hparams"]                   # (the saved run's: resume_config carries them)
    args.algo = values["algo"]
    # (a preset's hyperparameters give way to the saved run's)
    hparams = _checked_hparams(args, values, preset=False)
    args.algo = values["algo"]
    return runner.resume_config(out, **given, hparams=hparams)


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
            start_processes(args)
        else:
            fedjax_pfl.use_cpu_cores()  # before JAX starts: one XLA device per core (not on GPU)
        from fedjax_pfl import core, runner, sinks
        from fedjax_pfl.checkpoint import CheckpointError
        from fedjax_pfl.data.sources import DatasetNotFoundError
        from fedjax_pfl.errors import spelled

    with runner.interruptible():
        try:
            with said_warnings("run.py", lambda: args.algo):     # said once every check passed
                if args.resume is not None:
                    cfg = _resume_config(args, runner)
                    cfg.compile_cache = not args.no_compile_cache    # (this invocation's)
                    cfg.export = args.export
                else:
                    cfg = config_from_args(args)
                    args.algo = cfg.algo
                    cfg.export = args.export
                    cfg.validate()
                    runner.check_out(cfg.out, overwrite=args.overwrite)
                # The cache as `prepare` sets it, already for the data's own programs.
                fedjax_pfl.use_compile_cache(cfg.compile_cache)
                data, info = runner.compute(runner.load_data, cfg)
                prepared = runner.compute(runner.prepare, cfg, data, info)   # the algorithm's checks
        except DatasetNotFoundError as e:
            # One line, but keep everything the message says (where we looked, what to put where).
            text = spelled(e, spelling(cfg.algo))
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            _fail(f"--dataset {cfg.dataset}: {lines[0]} " + "; ".join(lines[1:]))
        except ValueError as e:
            _fail(message(e, args.algo))
        n = info["num_clients"]
        print(f"{cfg.algo} on {cfg.dataset}: {n} client{'' if n == 1 else 's'} "
              f"({info['train_size']['total']} train / {info['test_size']['total']} test samples), "
              f"output in {cfg.out}", flush=True)
        if args.seeds and len(args.seeds) > 1:
            return _run_seeds(cfg, args.seeds, data, info)
        try:
            summary = runner.run(cfg, prepared=prepared, log=lambda s: print(s, flush=True),
                                 callbacks=callbacks)
        except runner.NonFiniteError as e:
            _fail(spelled(e, spelling(cfg.algo)), code=1)
        except (core.MemoryPlanError, runner.ResumeError, CheckpointError,
                sinks.MissingExtraError) as e:
            _fail(message(e, cfg.algo))
    from fedjax_pfl.runner.records import compile_text

    best, last = summary["best"], summary["last"]
    print(f"done in {summary['wall_time_s']:.1f}s (compile {summary['compile_time_s']:.1f}s, "
          f"{compile_text(summary['compile'])}, "
          f"{summary['time_per_round_s'] * 1e3:.1f} ms/round, "
          f"{summary['client_steps_per_s']:.0f} client-steps/s)")
    for key in ("acc_mean", "acc_weighted", "acc_worst10", "global_acc_mean", "participant_best_mean"):
        if key in last:
            print(f"  {key:<22} last {last[key]:.4f}   best {best[key]:.4f} "
                  f"(round {summary['best_round'][key]})")
    if "privacy" in summary:
        print("  " + privacy_line(summary["privacy"]))
    if "target" in summary:
        target = summary["target"]
        print(f"  acc_mean >= {target['acc_mean']:g}: " + (f"reached at round {target['round']}"
              if target["round"] is not None else f"not reached in {summary['rounds']} rounds"))
    for key, value in summary.get("communication", {}).items():
        if key.endswith("_total"):
            print(f"  {key:<32} {value:,.0f}")
    for line in cost_lines(summary):
        print("  " + line)
    for line in (unseen_line(summary), attack_line(summary)):
        if line:
            print("  " + line)
    return 0


def attack_line(summary: dict) -> str | None:
    """The closing summary's line on the adversaries (summary.json's "attack"): "attack
    backdoor (6 of 20 malicious) at round 5   benign 0.8123   global benign 0.8011   asr
    0.9300"; None without malicious clients."""
    record = summary.get("attack")
    if not record:
        return None
    who = (f"{record['clients']} of {summary['clients']} malicious" if "clients" in record
           else f"{record['fraction']:g} malicious, re-drawn each round")
    text = f"{'attack ' + record['attack']:<22} {who}"
    if "round" in record:
        text += f" at round {record['round']}"
    for key, label in (("acc_mean_benign", "benign"), ("global_acc_mean_benign", "global benign"),
                       ("asr", "asr"), ("global_asr", "global asr")):
        if key in record:
            text += f"   {label} {record[key]:.4f}"
    return text


def unseen_line(summary: dict) -> str | None:
    """The closing summary's line on the held-out clients (summary.json's "unseen"): "unseen
    clients (4 of 20) at round 3  seen 0.8123  unseen 0.7011  gap 0.1112"; None without them."""
    record = summary.get("unseen")
    if not record:
        return None
    text = f"{'unseen clients':<22} {record['clients']} of {summary['clients']}"
    if "round" in record:
        text += f" at round {record['round']}"
    for key, label in (("acc_mean_seen", "seen"), ("acc_mean_unseen", "unseen"),
                       ("participation_gap", "gap")):
        if key in record:
            text += f"   {label} {record[key]:.4f}"
    return text


def cost_lines(summary: dict) -> list[str]:
    """The closing summary's fairness, convergence and cost lines (summary.json's "fairness",
    "convergence" and "cost"): "clients at round 3  std 0.0816  worst 10 % 0.7143  min 0.7143
    max 0.9310 (6 clients)", "95 % of best acc_mean 0.8620 first at round 2", the bytes sent
    each way and the round's FLOPs (or why there are none)."""
    lines = []
    fair = summary.get("fairness")
    if fair and "acc_std" in fair:
        lines.append(f"{'clients at round ' + str(fair['round']):<22} std {fair['acc_std']:.4f}   "
                     f"worst 10 % {fair['acc_worst10']:.4f}   min {fair['acc_min']:.4f}   "
                     f"max {fair['acc_max']:.4f} ({fair['clients']} clients)")
    conv = summary.get("convergence")
    if conv:
        lines.append(f"{'convergence':<22} {conv['fraction']:.0%} of best {conv['metric']} "
                     f"{conv['best']:.4f} first at round {conv['round']}")
    cost = summary.get("cost", {})
    for key in ("up_bytes_total", "down_bytes_total"):
        if key in cost:
            lines.append(f"{key:<32} {cost[key]:,.0f}")
    if cost.get("flops_per_round") is not None:
        lines.append(f"{'flops_per_round':<32} {cost['flops_per_round']:,.0f} "
                     f"(XLA, loops once; total {cost['flops_total']:,.0f})")
    elif "flops_unavailable" in cost:
        lines.append(f"{'flops_per_round':<32} none: {cost['flops_unavailable']}")
    return lines


def privacy_line(record: dict) -> str:
    """The closing summary's privacy line: ε at δ after the rounds done, z, C and how it was
    accounted ("privacy  ε = 2.87 at δ = 5e-02 (noise multiplier z = 1.12, clip C = 1,
    RDP accountant, fixed sampling)")."""
    eps = record.get("dp_epsilon")
    said = "unbounded" if eps is None or not math.isfinite(eps) else f"{eps:.4g}"
    clip = record.get("clip")
    parts = [f"noise multiplier z = {record['noise_multiplier']:.4g}",
             "adaptive clip" if record.get("adaptive_clip") else
             f"clip C = {clip:g}" if clip is not None else "no clip",
             f"{str(record.get('accountant', '')).upper()} accountant",
             f"{record.get('sampling')} sampling"]
    if record.get("target_epsilon") is not None:
        parts.append(f"for --target-epsilon {record['target_epsilon']:g}")
    return f"{'privacy':<22} ε = {said} at δ = {record['delta']:.3g} ({', '.join(parts)})"


def leave(status: int) -> None:
    """Ends a command-line process with `status`, its output flushed. After Ctrl-C or SIGTERM
    (130, 143) a worker thread may still be inside XLA: leave without interpreter teardown
    (tearing down around it is what used to end in a segfault, exit -11). After a lost process
    (75), JAX's exit would wait for it at the coordination service's shutdown barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status in (75, 130, 143):
        os._exit(status)
    if status == 0 and not _multi_process():
        # Everything the run writes is written and closed (files, checkpoints, the metric
        # sinks at on_run_end): the interpreter's teardown of JAX, XLA and the imported
        # modules only costs time (0.7-1 s of the main job). Several processes leave through
        # JAX's shutdown barrier instead, so that no peer takes the exit for a lost process.
        logging.shutdown()
        os._exit(0)
    sys.exit(status)


def _multi_process() -> bool:
    """Whether this process joined a multi-process run (JAX's distributed client is up)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client is not None


def _run_seeds(cfg, seeds, data, info) -> int:
    """--seeds: `sweep.run_seeds` (one vmapped program over the seeds; OUT/seed_S/ per run, the
    mean ± std in OUT/summary.json), printed."""
    from fedjax_pfl import runner, sweep
    from fedjax_pfl.errors import spelled

    try:
        aggregate, summaries = sweep.run_seeds(cfg, seeds, data=data, data_info=info)
    except runner.NonFiniteError as e:
        _fail(spelled(e, spelling(cfg.algo)), code=1)
    except (ValueError, TypeError) as e:
        _fail(f"--seeds: {message(e, cfg.algo)}")
    print(f"{len(seeds)} seeds in one program, {summaries[0]['group_wall_time_s']:.1f}s")
    for line in sweep.seeds_table(aggregate):
        print(line)
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except KeyboardInterrupt:            # Ctrl-C while Python starts up (imports)
        print("run.py: interrupted before the run started; nothing was written", file=sys.stderr)
        status = 130
    leave(status)
