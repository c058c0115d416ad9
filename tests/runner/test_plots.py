"""The label-distribution figure: a readable heatmap for 20 and for 100 clients."""

import matplotlib
import numpy as np
import pytest

from fedjax_pfl import plots
from fedjax_pfl.data import PartitionConfig, load_raw, partition_indices

pytestmark = pytest.mark.figures     # the writers themselves (tests/conftest.py stubs them elsewhere)

matplotlib.use("Agg")


def digits_counts(num_clients):
    raw = load_raw("digits", seed=0)
    parts = partition_indices(raw, PartitionConfig(scheme="dirichlet", num_clients=num_clients,
                                                   alpha=0.5, min_size=5))
    counts = np.zeros((num_clients, raw.num_classes), np.int64)
    for k, idx in enumerate(parts):
        np.add.at(counts[k], np.asarray(raw.y)[idx], 1)
    return counts


@pytest.mark.parametrize("num_clients,step", [(100, 5), (20, 1)])
def test_heatmap_has_integer_thinned_client_ticks_and_every_class(num_clients, step):
    import matplotlib.pyplot as plt

    counts = digits_counts(num_clients)
    fig = plots.label_distribution_figure(counts, title="digits")
    try:
        ax_size, ax, ax_bar = fig.axes
        # Colour is the count: the heatmap's data is the matrix itself (classes on the y axis).
        (image,) = ax.get_images()
        np.testing.assert_array_equal(np.asarray(image.get_array()), counts.T)
        # Client ticks: integers, every `step`th client, at most 25, starting at client 0.
        ticks = ax.get_xticks()
        np.testing.assert_array_equal(ticks, np.arange(0, num_clients, step))
        assert len(ticks) <= plots.MAX_CLIENT_TICKS
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == [str(int(t)) for t in ticks]
        # Every class labelled, in order.
        np.testing.assert_array_equal(ax.get_yticks(), np.arange(10))
        assert [t.get_text() for t in ax.get_yticklabels()] == [str(c) for c in range(10)]
        # A colourbar says what the colour means; the bars above give each client's size.
        assert ax_bar.get_ylabel() == "samples"
        heights = [p.get_height() for p in ax_size.patches]
        np.testing.assert_array_equal(heights, counts.sum(1))
    finally:
        plt.close(fig)


def test_share_colours_each_client_by_its_label_shares():
    import matplotlib.pyplot as plt

    counts = digits_counts(20)
    fig = plots.label_distribution_figure(counts, share=True)
    try:
        image = fig.axes[1].get_images()[0]
        np.testing.assert_allclose(np.asarray(image.get_array()).sum(0), 1.0)
        assert image.get_clim() == (0, 1)
    finally:
        plt.close(fig)


def test_tick_step_is_1_2_5_times_a_power_of_ten():
    assert [plots.client_tick_step(n) for n in (1, 25, 26, 50, 51, 100, 125, 126, 1000, 3000)] == \
        [1, 1, 2, 2, 5, 5, 5, 10, 50, 200]


def test_writes_a_png(tmp_path):
    path = tmp_path / "label_distribution.png"
    plots.plot_label_distribution(digits_counts(100), str(path), title="digits: dirichlet")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_many_clients_sizes_are_one_step_outline():
    """Beyond MAX_SIZE_BARS clients the sizes panel is one filled step outline (a bar patch per
    client took 26 s for 20,000), whose steps are the clients' sample counts."""
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 9, size=(plots.MAX_SIZE_BARS + 1, 3))
    fig = plots.label_distribution_figure(counts)
    try:
        ax_size = fig.axes[0]
        (outline,) = ax_size.patches
        values, edges, _ = outline.get_data()
        np.testing.assert_array_equal(values, counts.sum(1))
        np.testing.assert_array_equal(edges, np.arange(len(counts) + 1) - 0.5)
    finally:
        plt.close(fig)


def test_drawing_a_runs_figures_leaves_the_callers_backend_and_pyplot_alone(tmp_path):
    """A notebook's inline backend (here: whatever pyplot uses) is not switched to Agg by a run's
    figures, and no figure is left open in pyplot (the notebooks' later plt.show() works)."""
    import matplotlib
    import matplotlib.pyplot as plt

    from fedjax_pfl import plots

    before, opened = matplotlib.get_backend(), plt.get_fignums()
    matplotlib.use("svg")                            # a backend that is not Agg, as inline is not
    try:
        rows = [{"round": r, "acc_mean": 0.1 * r, "train_loss": 1.0 / r} for r in (1, 2, 3)]
        plots.plot_learning_curves({"fedavg": rows}, str(tmp_path / "curve.png"))
        plots.plot_label_distribution(np.array([[3, 1], [0, 4]]), str(tmp_path / "labels.png"))
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == opened
        assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "labels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        matplotlib.use(before)
