"""experiments/run.py with a pause after a given round, for tests that signal a real run at a
known point: `python tests/support/pause_run.py R <run.py flags>` prints "paused after round R" once
round R and its checkpoint are written, then sleeps (up to a minute) so the test can send its
signal. The pause is an ordinary round-end callback (fedjax_pfl.callbacks), run after the run's
own writers. With FEDJAX_PFL_TEST_NO_FIGURES=1 in the environment it draws no figures, as
tests/support/run_no_figures.py (for the tests that do not read them)."""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import run  # noqa: E402

from fedjax_pfl.callbacks import Callback  # noqa: E402

if os.environ.get("FEDJAX_PFL_TEST_NO_FIGURES") == "1":
    import no_figures  # (tests/support, this script's directory)

    no_figures.stub_all()


class PauseAfter(Callback):
    def __init__(self, round_number: int):
        self.round_number = round_number

    def on_round_end(self, event):
        if event.round == self.round_number:
            print(f"paused after round {event.round}", flush=True)
            time.sleep(60)


if __name__ == "__main__":
    run.leave(run.main(sys.argv[2:], callbacks=[PauseAfter(int(sys.argv[1]))]))
