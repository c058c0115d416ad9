#!/usr/bin/env python
"""Convert a natural-client dataset into its cache and print its statistics.

    python experiments/prepare.py --dataset shakespeare --data-dir DIR
    python experiments/prepare.py --dataset femnist --data-dir DIR --max-clients 100 \\
        --min-samples 10 --seed 0 --plots out/femnist

The format is detected from the files in DIR (LEAF: `train/*.json` and `test/*.json`; TensorFlow
Federated: `*_train.h5` / `*_test.h5`; FedJAX: `*.sqlite`; a reader module's own `detect` decides
where it has one) or forced with --format. The first
run converts the files into `DIR/.fedjax_pfl_cache/` (or --cache-dir); later runs open that
cache in seconds, and a stale one is rebuilt with a message. Values the cache cannot store exactly
(grey levels off the k/255 grid) are rounded to the nearest level and counted in the summary, or
refused with --quantise refuse. --max-clients / --min-samples take
LEAF's kind of subset (`data.cache.select`) before the statistics. --plots OUTDIR writes
OUTDIR/stats.json, client_sizes.png and labels.png (classification), lengths.png (token inputs)
or tags.png (multi-label).

Exit status 2 with one line on stderr for a missing dataset, a bad file or a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedjax_pfl.data.formats import FORMATS, READERS, UsageError, detect_format, open_reader  # noqa: E402,F401
from fedjax_pfl.data.natural import QUANTISE  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag: one line on stderr (no usage block), exit 2."""
        self.exit(2, f"prepare.py: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help="femnist, emnist62, shakespeare, stackoverflow_nwp, "
                   "stackoverflow_tp, sent140, cifar100_fl")
    p.add_argument("--data-dir", required=True, help="the directory with the dataset's files")
    p.add_argument("--format", choices=FORMATS, default=None, help="file format (default: detected)")
    p.add_argument("--cache-dir", default=None, help="cache root (default: DATA_DIR/.fedjax_pfl_cache)")
    p.add_argument("--max-clients", type=int, default=None, help="keep at most K clients, drawn at random")
    p.add_argument("--min-samples", type=int, default=0, help="keep clients with >= S training samples")
    p.add_argument("--seed", type=int, default=0, help="seed of the --max-clients draw")
    p.add_argument("--plots", default=None, metavar="OUTDIR", help="write stats.json and figures here")
    p.add_argument("--quantise", choices=QUANTISE, default="round",
                   help="values the cache cannot store exactly (grey levels off the k/255 grid): round "
                        "stores the nearest level and reports the count in the summary, refuse stops "
                        "with an error (default round)")
    return p


def write_plots(stats: dict, nc, outdir: str) -> list[str]:
    """OUTDIR/stats.json and the figures; returns the paths written."""
    from fedjax_pfl import plots

    os.makedirs(outdir, exist_ok=True)
    written = [os.path.join(outdir, "stats.json")]
    with open(written[0], "w") as f:
        json.dump(stats, f, indent=1)
    name = stats["dataset"]
    figures = [("client_sizes.png", plots.client_sizes_figure(nc.train_counts(), nc.test_counts(),
                                                              title=f"{name}: samples per client"))]
    train = stats["train"]

    def names(n: int) -> list[str]:
        labels = list(nc.source.labels)
        return labels if len(labels) == n else [str(i) for i in range(n)]

    if "label_counts" in train:
        counts = np.asarray(train["label_counts"])
        figures.append(("labels.png", plots.counts_figure(counts, xlabel="class", names=names(counts.size),
                                                          title=f"{name}: training labels")))
    if "length_histogram" in train:
        figures.append(("lengths.png", plots.counts_figure(np.asarray(train["length_histogram"]),
                                                           xlabel="real tokens per sample",
                                                           title=f"{name}: training sequence lengths")))
    if "tag_counts" in train:
        counts = np.asarray(train["tag_counts"])
        figures.append(("tags.png", plots.counts_figure(counts, xlabel="tag", names=names(counts.size),
                                                        title=f"{name}: training tags")))
    for filename, fig in figures:
        path = os.path.join(outdir, filename)
        plots.save_figure(fig, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit status (0, or 2 after a one-line error on stderr)."""
    try:
        args = parse_args(argv)
    except SystemExit as e:                           # --help (0) or a bad flag (2, already said)
        return int(e.code or 0)
    from fedjax_pfl.data import cache, stats
    from fedjax_pfl.data.natural import DataFormatError
    from fedjax_pfl.data.sources import DatasetNotFoundError

    try:
        if args.max_clients is not None and args.max_clients < 1:
            raise UsageError(f"--max-clients must be >= 1, got {args.max_clients}")
        if args.min_samples < 0:
            raise UsageError(f"--min-samples must be >= 0, got {args.min_samples}")
        reader = open_reader(args.dataset, args.data_dir, args.format, quantise=args.quantise)
        root = args.cache_dir or cache.default_cache_root(args.data_dir)
        nc = cache.load(reader, root)
        idx = cache.select(nc, max_clients=args.max_clients, min_samples=args.min_samples, seed=args.seed)
        if idx.size != nc.num_clients:
            print(f"selected {idx.size:,} of {nc.num_clients:,} clients (--min-samples {args.min_samples}, "
                  f"--max-clients {args.max_clients}, --seed {args.seed})")
        nc = cache.subset(nc, idx)
        summary = stats.describe(nc)
        summary["selection"] = {"max_clients": args.max_clients, "min_samples": args.min_samples,
                                "seed": args.seed, "client_indices_kept": int(idx.size)}
        print(stats.format_table(summary))
        if args.plots:
            for path in write_plots(summary, nc, args.plots):
                print(f"wrote {path}")
    except (DatasetNotFoundError, DataFormatError, cache.StaleCacheError, UsageError, ValueError) as e:
        print(f"prepare.py: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:                              # unreadable file, read-only cache root, ...
        print(f"prepare.py: error: {_one_line(e)} (choose a writable cache root with --cache-dir if it "
              f"is the cache)" if isinstance(e, PermissionError) else f"prepare.py: error: {_one_line(e)}",
              file=sys.stderr)
        return 2
    return 0


def _one_line(e: BaseException) -> str:
    return message(e) or type(e).__name__


def message(e: BaseException) -> str:
    """What prepare.py says for an error, one line: the data options the library's errors name
    (`fedjax_pfl.errors.arg`: data_dir, fmt, max_clients, …) as its flags."""
    from fedjax_pfl.errors import spelled

    flags = {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}
    spell = lambda name, space: flags.get({"fmt": "format"}.get(name, name))  # noqa: E731
    return " ".join(spelled(e, spell).split())


if __name__ == "__main__":
    sys.exit(main())
