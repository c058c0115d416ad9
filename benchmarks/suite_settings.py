"""What the test suite's process settings (tests/conftest.py) save: jemalloc, the frozen garbage
collector, one LLVM module per program, and zstd for the shared compilation cache's entries
(`zstandard`, in the `test` extra; off: JAX falls back to zlib).

    python benchmarks/suite_settings.py                    # each setting off against all on
    python benchmarks/suite_settings.py --off malloc --repeats 3

On a shared 2-core VM, runs of the same tests one after another differ by 10–30 % with the host's
load, more than what a setting saves. So the two configurations run AT THE SAME TIME, each as one
pytest process pinned to its own core (`taskset`), and swap cores every repeat; the ratio of their
CPU seconds is read within each repeat. The tests are a fixed mix of algorithm, program and
privacy files (`--files`), run without xdist: the settings reach the process through the
environment, as they reach the suite's xdist workers (jemalloc is preloaded into the pytest process
here instead of by conftest.py, which can set LD_PRELOAD only for the processes it starts).
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("tests/algorithms/test_pgfed.py", "tests/algorithms/test_fedavg.py",
         "tests/core/test_program.py", "tests/privacy/test_adaptive_clip.py")
# How to turn each setting off (conftest.py leaves a flag the environment already names alone).
OFF = {
    "malloc": {"FEDJAX_PFL_TEST_MALLOC": "system"},
    "gc": {"FEDJAX_PFL_TEST_GC": "default"},
    "split": {"XLA_FLAGS": "--xla_cpu_parallel_codegen_split_count=32"},
    "zstd": {},             # (a sitecustomize that hides zstandard: `configuration`)
}
# JAX's compilation cache uses zstandard when it can import it: the "off" configuration puts a
# sitecustomize first on the path that makes the import fail.
NO_ZSTD = tempfile.mkdtemp(prefix="no_zstandard_")
with open(os.path.join(NO_ZSTD, "sitecustomize.py"), "w") as _f:
    _f.write("import sys\nsys.modules['zstandard'] = None\n")


def configuration(off: tuple[str, ...]) -> dict[str, str]:
    env = dict(os.environ)
    for name in off:
        env.update(OFF[name])
    if "zstd" in off:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (NO_ZSTD, env.get("PYTHONPATH")) if p)
    else:
        try:
            import zstandard  # noqa: F401  (only whether it imports)
        except ImportError:
            sys.exit("zstandard is not installed (pip install -e '.[test]')")
    if "malloc" not in off:
        lib = ctypes.util.find_library("jemalloc")      # what tests/conftest.py preloads
        if lib is None:
            sys.exit("jemalloc is not installed (Debian: apt-get install libjemalloc2)")
        env["LD_PRELOAD"] = lib
    return env


def start(env: dict[str, str], core: int, files: list[str], log):
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-n", "0", *files]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def cpu_seconds(process: subprocess.Popen) -> float:
    """The finished process's own CPU seconds (user + system, its children included)."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"a pytest run failed: {' '.join(process.args)}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--off", nargs="+", choices=[*OFF, "all"], default=[*OFF, "all"],
                        help="the settings to compare with all on, one at a time ('all': every one off)")
    parser.add_argument("--repeats", type=int, default=2, help="pairs per comparison (cores swapped)")
    parser.add_argument("--files", nargs="+", default=list(FILES))
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs two cores: the two configurations run side by side")
    on = configuration(())
    print(f"tests: {' '.join(args.files)}\nload before: {os.getloadavg()[0]:.2f}")
    for name in args.off:
        off = configuration(tuple(OFF) if name == "all" else (name,))
        ratios = []
        for repeat in range(args.repeats):
            cores = (0, 1) if repeat % 2 == 0 else (1, 0)
            with tempfile.TemporaryFile() as log_on, tempfile.TemporaryFile() as log_off:
                p_on = start(on, cores[0], args.files, log_on)
                p_off = start(off, cores[1], args.files, log_off)
                t_on, t_off = cpu_seconds(p_on), cpu_seconds(p_off)
            ratios.append(t_on / t_off)
            print(f"{name} off: {t_off:7.1f} CPU s, all on: {t_on:7.1f} CPU s, on ÷ off {t_on / t_off:.3f}"
                  f"  (load {os.getloadavg()[0]:.2f})", flush=True)
        print(f"{name}: on ÷ off median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}–{max(ratios):.3f}) over {len(ratios)} pairs")


if __name__ == "__main__":
    main()
