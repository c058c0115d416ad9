"""experiments/run.py without drawing the run's two PNGs, for subprocess tests that compare a
run's metrics, checkpoints and summary but not its figures: `python tests/support/run_no_figures.py
<run.py flags>` is `python experiments/run.py <run.py flags>` with every figure writer
(`plots.plot_*`) doing nothing. Importing matplotlib and drawing the figures took ~1.5 s of CPU
a run directory (tests/conftest.py's
`_no_figures` does the same in-process). Tests that check that a run writes its figures
(tests/cli/test_cli.py, tests/system/test_interrupts.py's stopped runs) use the real script.

With FEDJAX_PFL_TEST_HOST_READS=DIR set, each process writes DIR/reads-K.json (K its process
index): the arrays of the checkpoints' per-process host parts it read
(`HostArrays.read_from_parts`) and the files it hashed to verify checkpoints.

Exits as experiments/run.py's `__main__` does (75/130/143 without interpreter teardown)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import no_figures  # noqa: E402  (tests/support, this script's directory)
import run  # noqa: E402

no_figures.stub_all()

_host_reads, _hashed = [], []
if os.environ.get("FEDJAX_PFL_TEST_HOST_READS"):
    from fedjax_pfl import checkpoint

    _read_host, _sha256 = checkpoint.read_host, checkpoint._sha256
    checkpoint.read_host = lambda path: _host_reads.append(_read_host(path)) or _host_reads[-1]
    checkpoint._sha256 = lambda file: _hashed.append(file) or _sha256(file)


def _write_host_reads():
    import json

    import jax

    out = os.path.join(os.environ["FEDJAX_PFL_TEST_HOST_READS"], f"reads-{jax.process_index()}.json")
    with open(out, "w") as f:
        json.dump({"parts": sorted({k for arrays in _host_reads for k in arrays.read_from_parts}),
                   "hashed": _hashed}, f)


if __name__ == "__main__":
    status = run.main(sys.argv[1:])
    if os.environ.get("FEDJAX_PFL_TEST_HOST_READS"):
        _write_host_reads()
    run.leave(status)
