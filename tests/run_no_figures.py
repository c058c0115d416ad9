"""experiments/run.py without drawing the run's two PNGs, for subprocess tests that compare a
run's metrics, checkpoints and summary but not its figures: `python tests/run_no_figures.py
<run.py flags>` is `python experiments/run.py <run.py flags>` with
`plots.plot_label_distribution` and `plots.plot_learning_curves` doing nothing. Importing
matplotlib and drawing the two figures took ~1.5 s of CPU a run directory (tests/conftest.py's
`no_figures` does the same in-process). Tests that check that a run writes its figures
(tests/test_cli.py, tests/test_interrupts.py's stopped runs) use the real script.

Exits as experiments/run.py's `__main__` does (130/143 without interpreter teardown)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import run  # noqa: E402
from fedjax_pfl import plots  # noqa: E402

plots.plot_label_distribution = lambda *args, **kwargs: None
plots.plot_learning_curves = lambda *args, **kwargs: None

if __name__ == "__main__":
    status = run.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status) if status in (130, 143) else sys.exit(status)
