"""summary.json's fairness, cost and convergence (issue 57, item 4), each recomputed here from
what the run wrote (client_metrics.npz, metrics.jsonl) or from a closed form:

  * "fairness": the std (ddof = 0), bottom decile (mean of the ⌈N/10⌉ lowest), best and worst of
    the last evaluation's per-client accuracies, from client_metrics.npz's accuracy[-1];
  * "cost": bytes = Σ_rounds comm_*_floats × 4 (float32), FedPC's compressed uplink as bits / 8;
    FLOPs of the round from XLA against 2·B·F·C a forward and 2·B·F·C a backward of a linear
    model's batch (a loop's body counted once: one local step per client, one round per call);
  * "convergence": the first round whose acc_mean reaches 95 % of its best, from metrics.jsonl;
  * client_accuracy.png: the sorted bars are the sorted final accuracies.
"""

import math

import numpy as np
import pytest
from helpers import finished_cli_run

from fedjax_pfl import plots, runner
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.runner import records

CLIENTS, ROUNDS = 12, 3


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One tiny CLI run (FedAvg on digits, 12 clients, 3 rounds): its directory and its output.
    Module-scoped, it is set up before tests/conftest.py's function-scoped `_no_figures`: the run
    draws its figures (test_the_figure_and_its_bars reads one)."""
    out = tmp_path_factory.mktemp("fair")
    summary, rows, printed = finished_cli_run(out, ["--algo", "fedavg", "--rounds", str(ROUNDS),
                                                    "--clients", str(CLIENTS)])
    return out, summary, rows, printed


@pytest.mark.slow
def test_fairness_is_the_spread_of_the_final_per_client_accuracies(cli_run):
    out, summary, _, printed = cli_run
    npz = np.load(out / "client_metrics.npz")
    acc = npz["accuracy"][-1]
    acc = acc[~np.isnan(acc)]
    assert acc.size == CLIENTS
    worst = sorted(acc.tolist())[:2]          # ⌈12/10⌉ = 2 clients (floor would give 1)
    fair = summary["fairness"]
    assert fair["round"] == int(npz["eval_rounds"][-1]) == ROUNDS
    assert fair["clients"] == CLIENTS
    np.testing.assert_allclose(fair["acc_std"], math.sqrt(np.mean((acc - acc.mean()) ** 2)),
                               rtol=1e-12)
    np.testing.assert_allclose(fair["acc_worst10"], sum(worst) / 2, rtol=1e-12)
    assert fair["acc_min"] == min(acc) and fair["acc_max"] == max(acc)
    # The same definitions as the last round's row of metrics.jsonl.
    assert fair["acc_worst10"] == pytest.approx(summary["last"]["acc_worst10"], rel=1e-12)
    assert f"std {fair['acc_std']:.4f}" in printed
    assert f"worst 10 % {fair['acc_worst10']:.4f}" in printed
    assert f"max {fair['acc_max']:.4f} ({CLIENTS} clients)" in printed


@pytest.mark.slow
def test_bytes_are_the_floats_sent_times_four(cli_run):
    _, summary, rows, printed = cli_run
    cost = summary["cost"]
    up = sum(r["comm_up_floats"] for r in rows)
    down = sum(r["comm_down_floats"] for r in rows)
    assert up > 0 and down > 0
    assert cost["up_bytes_total"] == 4 * up and cost["down_bytes_total"] == 4 * down
    assert cost["up_bytes_from"] == "up_floats x 4 (float32)"
    assert f"{4 * up:,.0f}" in printed


def test_compressed_uplink_bytes_are_its_bits_over_eight():
    """FedPC counts the bits of its packed uplink: those, not its dense float count, are sent."""
    comm = {"up_floats_total": 1000.0, "up_bits_total": 4000.0, "down_floats_total": 1000.0}
    cost = records.communication_bytes(comm)
    assert cost["up_bytes_total"] == 500.0 and cost["up_bytes_from"] == "up_bits / 8"
    assert cost["down_bytes_total"] == 4000.0
    assert records.communication_bytes({}) == {}


def test_convergence_round_by_hand(cli_run):
    _, summary, rows, printed = cli_run
    acc = {r["round"]: r["acc_mean"] for r in rows if "acc_mean" in r}
    best = max(acc.values())
    first = min(r for r, a in acc.items() if a >= 0.95 * best)
    conv = summary["convergence"]
    assert conv["metric"] == "acc_mean" and conv["best"] == best == summary["best"]["acc_mean"]
    assert conv["round"] == first and conv["threshold"] == pytest.approx(0.95 * best)
    assert f"first at round {first}" in printed


def test_first_round_reaching_cases():
    from fedjax_pfl.core.metrics import first_round_reaching

    rows = [{"round": 1, "a": 0.5}, {"round": 2}, {"round": 3, "a": 0.96},
            {"round": 4, "a": float("nan")}, {"round": 5, "a": 1.0}]
    assert first_round_reaching(rows, "a", 0.95) == (0.95, 3)
    assert first_round_reaching(rows, "a", 0.5) == (0.5, 1)
    assert first_round_reaching(rows, "b", 0.95) is None


def test_the_figure_and_its_bars(cli_run):
    out, summary, _, _ = cli_run
    assert (out / "client_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    acc = np.array([0.9, np.nan, 0.2, 0.5, 0.7])
    fig = plots.client_accuracy_figure(acc)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [0.2, 0.5, 0.7, 0.9]
    lines = sorted(line.get_ydata()[0] for line in fig.axes[0].lines)
    np.testing.assert_allclose(lines, [0.2, (0.2 + 0.5 + 0.7 + 0.9) / 4])   # worst ⌈0.4⌉ = 1, mean
    counts = [p.get_height() for p in fig.axes[1].patches]
    assert sum(counts) == 4
    with pytest.raises(ValueError, match="no evaluated client"):
        plots.client_accuracy_figure(np.full(3, np.nan))


def test_flops_total_is_per_round_times_rounds(cli_run):
    cost = cli_run[1]["cost"]
    assert cost["flops_per_round"] > 0 and cost["flops_counts_loops_once"] is True
    assert cost["flops_total"] == ROUNDS * cost["flops_per_round"]
    assert "flops_per_round" in cli_run[3]


M, B, C = 4, 8, 10


def _linear_data(features: int) -> FederatedData:
    """M clients of B training samples each (one local step per epoch), 2 test samples."""
    rng = np.random.default_rng(0)
    n = M * (B + 2)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = rng.integers(0, C, n)
    train = [np.arange(i * (B + 2), i * (B + 2) + B) for i in range(M)]
    test = [np.arange(i * (B + 2) + B, (i + 1) * (B + 2)) for i in range(M)]
    return FederatedData.from_arrays(x, y, train, test, num_classes=C, name="linear")


def _round_flops(features: int, epochs: int = 1, rounds_per_call: int = 1) -> float:
    cfg = runner.RunConfig(algo="fedavg", model="logreg", rounds=2, out=None, progress=False,
                           rounds_per_call=rounds_per_call, eval_every=2,
                           hparams=dict(lr=0.1, batch_size=B, local_epochs=epochs,
                                        participation=1.0))
    prep = runner.prepare(cfg, _linear_data(features))
    prep.program.compile(prep.round_keys)
    flops = records.round_flops(prep.program, 2)
    assert flops["flops_total"] == 2 * flops["flops_per_round"]
    return flops["flops_per_round"]


@pytest.mark.slow
def test_round_flops_against_a_linear_models_closed_form():
    """One local step of a client on a [B, F] batch of softmax regression: the forward x·W,
    2·B·F·C flops, and the kernel's gradient xᵀ·δ, 2·B·F·C (x needs no gradient); M clients.
    Per weight and client, the SGD step θ − η·g (2 flops) and the server's weighted sum of the
    clients' models (a multiply and an add: 2). The F-independent rest (sampling, shuffling,
    softmax, the bias) cancels in the difference of two widths:
    Δflops = M·C·ΔF·(4·B + 4) (within 2 %: room for a server step of 2 flops a weight, not per
    client). The local-step loop counts once (XLA's cost analysis counts a loop's
    body once): two epochs add less than a tenth of a step (their longer shuffle), and so does a
    call of two rounds (one round per scan body, not divided by K)."""
    narrow, wide = _round_flops(256), _round_flops(512)
    assert wide - narrow == pytest.approx(M * C * 256 * (4 * B + 4), rel=0.02)
    assert wide > 4 * M * B * C * 512
    step = 4 * M * B * C * 512                 # what one more counted step would add
    assert abs(_round_flops(512, epochs=2) - wide) < 0.1 * step      # (the shuffle of 2·B ids)
    assert abs(_round_flops(512, rounds_per_call=2) - wide) < 0.1 * step


def test_flops_unavailable_says_why():
    class Eager:
        jit, _round_compiled = False, None

    class Failing:
        jit = True

        class _round_compiled:                 # noqa: N801  (a stand-in compiled program)
            @staticmethod
            def cost_analysis():
                raise RuntimeError("no cost model")

    eager = records.round_flops(Eager(), 3)
    assert eager["flops_per_round"] is None and "loop or debug backend" in eager["flops_unavailable"]
    failing = records.round_flops(Failing(), 3)
    assert failing["flops_total"] is None and "no cost model" in failing["flops_unavailable"]
    assert "not compiled" in records.round_flops(None, 0)["flops_unavailable"]


def test_a_fresh_start_removes_a_previous_runs_figure(tmp_path):
    """A new run in the same --out clears the old client_accuracy.png (a run file), keeps others'."""
    from fedjax_pfl.runner import rundir

    (tmp_path / "client_accuracy.png").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("mine")
    rundir.clear_out(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
