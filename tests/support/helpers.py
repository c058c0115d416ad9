"""Test helpers: tiny federated datasets and models whose behaviour can be worked out by hand."""

from __future__ import annotations

import contextlib
import functools
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

# The algorithms that stand for all of them in the cross-cutting matrix tests (those marked
# `matrix`: every algorithm x one engine feature) of the README's test command: one of each kind of
# state and model the engine places, shards, privatises and checkpoints. A global model (FedAvg),
# a split model with staged epochs (FedRep), per-client models beside a global one (Ditto), a
# pairwise server with an N x N matrix and momentum rows (PGFedMo), a client graph (FedPC), CP
# layers (TDPFed) and adapters on a frozen base (FFA-LoRA). Each matrix's own quick cases run too.
# `pytest --extended` runs every algorithm (tests/conftest.py; docs/decisions/test-suite-time.md).
REPRESENTATIVE = ("fedavg", "fedrep", "ditto", "pgfedmo", "fedpc", "tdpfed", "ffa_lora")


def make_data(sizes, *, num_classes=3, feature_dim=5, test_sizes=None, seed=0, images=False):
    """Clients with the given training sizes (ragged on purpose) and small test splits."""
    x, y, train, test, scale, shift = make_raw(sizes, num_classes=num_classes,
                                               feature_dim=feature_dim, test_sizes=test_sizes,
                                               seed=seed, images=images)
    return FederatedData.from_arrays(x, y, train, test, num_classes=num_classes,
                                     input_scale=scale, input_shift=shift, name="toy")


def make_raw(sizes, *, num_classes=3, feature_dim=5, test_sizes=None, seed=0, images=False):
    """The arrays behind `make_data`: (x, y, train index lists, test index lists, scale, shift).

    Raw rows are laid out client by client: client k's train rows, then its test rows.
    """
    rng = np.random.default_rng(seed)
    test_sizes = test_sizes or [max(1, s // 3) for s in sizes]
    total = sum(sizes) + sum(test_sizes)
    if images:
        x = rng.integers(0, 256, (total, 8, 8, 1), dtype=np.uint8)
        scale, shift = 2 / 255, -1.0
    else:
        x = rng.normal(size=(total, feature_dim)).astype(np.float32)
        scale, shift = 1.0, 0.0
    y = rng.integers(0, num_classes, total)
    train, test, start = [], [], 0
    for n_train, n_test in zip(sizes, test_sizes):
        train.append(np.arange(start, start + n_train))
        test.append(np.arange(start + n_train, start + n_train + n_test))
        start += n_train + n_test
    return x, y, train, test, scale, shift


def linear_model(feature_dim=5, num_classes=3) -> Model:
    """Softmax regression with parameters {'w': [F, C], 'b': [C]}. Its representation
    (`features`, MOON's z) is x·w, the input of the bias b, the head in the algorithms'
    test_hparams ('^b$'), so that a contrastive loss on it has a gradient."""

    def init(key):
        kw, kb = jax.random.split(key)
        return {"w": 0.3 * jax.random.normal(kw, (feature_dim, num_classes)),
                "b": 0.1 * jax.random.normal(kb, (num_classes,))}

    def apply(params, x):
        return x.reshape(x.shape[0], -1) @ params["w"] + params["b"]

    return Model(init=init, apply=apply, name="linear",
                 features=lambda params, x: x.reshape(x.shape[0], -1) @ params["w"])


def tree_allclose(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def assert_states_close(got, want, *, rtol=2e-5, atol=1e-6):
    """Every field of two states agrees: the same tree structure (so no field can be left out)
    and every leaf close, integer and bool leaves equal; a failure names the field's path."""
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
    assert got_tree == want_tree, f"state structures differ:\n{got_tree}\n{want_tree}"
    assert got_leaves, "empty state"
    for (path, x), (_, y) in zip(got_leaves, want_leaves):
        name = jax.tree_util.keystr(path)
        if jax.dtypes.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(y.dtype, np.inexact):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)


# XLA's own defaults (the product's), against the suite's fast-compile flags (tests/conftest.py):
# for claims that two different programs agree bit for bit, which hold at the settings users run
# with but may break by an ulp at others (PGFed with mu = 0 against FedAvg does at -O0).
def _jaxlib_version() -> tuple[int, int]:
    import importlib.metadata

    return tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])


PRODUCT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 2}
if _jaxlib_version() < (0, 11):     # (newer XLA has only the fusion emitters, and no such option)
    PRODUCT_COMPILER_OPTIONS["xla_cpu_use_fusion_emitters"] = True


def product_jit(fn, **kwargs):
    """jax.jit(fn) compiled at XLA's default settings (PRODUCT_COMPILER_OPTIONS)."""
    return jax.jit(fn, compiler_options=PRODUCT_COMPILER_OPTIONS, **kwargs)


def tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def states_per_backend(name, data, *, rounds=3, backends=("loop", "vmap", "chunked"), **hparams):
    """The state after `rounds` rounds of algorithm `name` on each backend (same keys throughout)."""
    from fedjax_pfl import algorithms

    states = {}
    for backend in backends:
        algo = algorithms.get(name, backend=backend, **hparams)
        state = algo.init(jax.random.key(0), data)
        step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
        for r in range(rounds):
            state, _ = step(state, data, jax.random.key(r))
        states[backend] = state
    return states


def without_device_count(xla_flags: str) -> str:
    """XLA_FLAGS without a forced host device count (a subprocess sets its own), other flags kept."""
    return " ".join(f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count"))


# The algorithms whose command line with nothing else is a refusal, and the fewest flags that
# make it a run (tests/runner/test_defaults_train.py checks both): FFA-LoRA is defined on LoRA
# adapters, which the digits MLP has only with --peft (adapters on a random base take a larger
# step than the full model's 0.05).
ALGO_FLAGS: dict[str, tuple[str, ...]] = {
    "ffa_lora": ("--peft", "lora", "--lora-targets", "all", "--lr", "0.5"),
}


@functools.lru_cache(maxsize=None)
def default_prepared(algo: str):
    """`runner.prepare` of `python experiments/run.py --algo ALGO` (digits, 20 clients), built and
    compiled once per test process: tests/runner/test_defaults_train.py trains it to its accuracy bar and
    stops and resumes it (`check_resume_equals_uninterrupted`); a Prepared does not depend on
    --rounds or --out."""
    import run as cli  # experiments/run.py (importing it starts nothing)

    from fedjax_pfl import runner

    return runner.prepare(cli.config_from_args(cli.parse(["--algo", algo, "--quiet",
                                                          *ALGO_FLAGS.get(algo, ())])))


def default_config(algo: str, out, rounds: int, *flags: str, checkpoint_every: int = 2):
    """The command line's default configuration of `algo` (digits, 20 clients), whose prepared and
    compiled program is `default_prepared(algo)`, with these rounds, output and checkpoints."""
    import run as cli

    return cli.config_from_args(cli.parse(["--algo", algo, "--quiet", *ALGO_FLAGS.get(algo, ()),
                                           "--out", str(out), "--rounds", str(rounds),
                                           "--checkpoint-every", str(checkpoint_every), *flags]))


def metric_rows(out) -> list[dict]:
    """metrics.jsonl of a run directory without round_time (wall clock, the only field that may
    differ between two runs of the same configuration)."""
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("round_time")
    return rows


def host_array(leaf) -> np.ndarray:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def check_resume_equals_uninterrupted(algo: str, tmp_path, rounds: int = 4, stop: int = 2) -> None:
    """Issue 11 §1: the default configuration of `algo` stopped at round `stop` (its checkpoint)
    and resumed writes the same metrics, client metrics and final state, bit for bit, as a run of
    `rounds` rounds that was never stopped."""
    from fedjax_pfl import checkpoint, runner

    prep = default_prepared(algo)                   # the same configuration, compiled once
    quiet = lambda *_: None
    full = runner.run(default_config(algo, tmp_path / "full", rounds, checkpoint_every=stop),
                      prepared=prep, log=quiet)
    runner.run(default_config(algo, tmp_path / "resumed", stop, checkpoint_every=stop),
               prepared=prep, log=quiet)
    assert runner.latest_checkpoint(str(tmp_path / "resumed")).endswith(f"round_{stop:06d}")
    resumed = runner.run(default_config(algo, tmp_path / "resumed", rounds, "--resume",
                                        checkpoint_every=stop), prepared=prep, log=quiet)

    assert metric_rows(tmp_path / "resumed") == metric_rows(tmp_path / "full")
    assert resumed["best"] == full["best"] and resumed["last"]["acc_mean"] == full["last"]["acc_mean"]
    like = prep.program.init(jax.random.fold_in(prep.root, 0))    # (FedPC: shapes from its graph)
    final = f"round_{rounds:06d}"
    a = checkpoint.restore(str(tmp_path / "full" / "checkpoints" / final), like=like)
    b = checkpoint.restore(str(tmp_path / "resumed" / "checkpoints" / final), like=like)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(host_array(x), host_array(y))
    npz_full = np.load(tmp_path / "full" / "client_metrics.npz")
    npz_res = np.load(tmp_path / "resumed" / "client_metrics.npz")
    for key in ("sampled", "eval_rounds", "accuracy"):
        np.testing.assert_array_equal(npz_full[key], npz_res[key])


# XLA:CPU's vectorised reductions may give an evaluated client's float sums (its test loss)
# bits that depend on how many clients are evaluated together: host placement's groups and
# device placement's whole evaluation then agree to an ulp, not bit for bit (the rounds still
# do). Seen from jaxlib 0.11 everywhere (0.12.0.1, at XLA's defaults and at -O0 alike) and with
# jaxlib 0.10.2 on some machines (an AMD EPYC with 1 MiB of L2 per core, 2026-12-02), so the
# evaluations' float leaves are compared within 4 ulps on every machine.
EVAL_BITS_DEPEND_ON_GROUPING = True


def assert_evaluations_equal(a, b):
    """Two evaluations of the same state under different client groupings: equal bit for bit,
    or, where XLA's bits depend on the grouping (EVAL_BITS_DEPEND_ON_GROUPING), their float
    leaves within 4 ulps (integer leaves, e.g. correct counts, still exactly)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        if EVAL_BITS_DEPEND_ON_GROUPING and np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=4 * np.finfo(x.dtype).eps, atol=0)
        else:
            np.testing.assert_array_equal(x, y)


def shared_floats(tree, mask) -> list[np.ndarray]:
    """The float leaves of a state that are not per-client (`core.client_mask` False), in float64:
    what the server holds."""
    return [np.asarray(x, np.float64) for x, c in zip(jax.tree.leaves(tree), jax.tree.leaves(mask))
            if not c and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]


def client_rows(tree, mask) -> list[np.ndarray]:
    """The per-client leaves of a state (`core.client_mask` True) as NumPy arrays (PRNG keys as
    their key data)."""
    return [host_array(jnp.asarray(x)) for x, c in zip(jax.tree.leaves(tree), jax.tree.leaves(mask))
            if c]


@contextlib.contextmanager
def ctrl_c_for_children():
    """Children started within start with Ctrl-C's default disposition, unblocked, as from an
    interactive shell, whatever the pytest worker has (an ignored or blocked SIGINT is inherited
    across exec, as by a script's background jobs, and then Ctrl-C cannot stop the child)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def snapshot(root) -> dict:
    """Every file and folder under `root`: relative path -> (bytes, mtime in ns) or 'dir'."""
    out = {}
    for base, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(base, d), root)] = "dir"
        for f in files:
            path = os.path.join(base, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = (fh.read(), os.stat(path).st_mtime_ns)
    return out


def finished_cli_run(out, argv):
    """experiments/run.py's `main(argv + --out out --quiet)` in this process, which must exit 0:
    (summary.json, metrics.jsonl's rows, what it printed)."""
    import io
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    import run as cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main([*argv, "--out", str(out), "--quiet"])
    assert code == 0, printed.getvalue()[-2000:]
    summary = json.loads((Path(out) / "summary.json").read_text())
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, printed.getvalue()
