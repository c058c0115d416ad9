"""fedjax_pfl beside pfl-research and Flower on the same federated job, step for step (issue 36).

    python benchmarks/peers/harness.py --smoke                      # do the three still run?
    python benchmarks/peers/harness.py --jobs cifar10 --rounds 5 --repeats 3
    python benchmarks/peers/harness.py --jobs pgfed --rounds 3 --repeats 2 --variants quiet contended
    python benchmarks/peers/harness.py --device cuda --variants quiet --python-pfl python3 ...

What it does (README.md beside this file has the details):
1. Makes one virtual environment per peer under --venv-dir (default benchmarks/peers/.venvs):
   `pfl` gets torch + pfl, `flower` gets torch + flwr[simulation]. torch is the CPU build: the
   wheel --torch-wheel (or $PEERS_TORCH_WHEEL) names, else PyTorch's CPU index, else PyPI's
   default torch (on Linux that one carries CUDA libraries); the run says which it used.
   fedjax_pfl runs in the interpreter running this script (the repository's environment).
2. Writes each job once (`prepare.py`): data, client split, per-round client lists and the
   initial weights, in one .npz every runner reads.
3. Runs every side in a fresh process, sides interleaved and their order rotated each repeat,
   each repeat once on the quiet machine and once beside a fixed neighbour (--burners processes
   spinning on a core each), with OMP_WAIT_POLICY=PASSIVE and the peers' telemetry off; for
   fedjax_pfl the contended variant also runs with one XLA device (--contended-devices).
4. Refuses the comparison (exit status 1, "REFUSED") if any side's local steps per round differ from the others'.
5. Prints medians with ranges: start-up (process start to round 1), round 1, steady seconds
   per round (median of rounds 2..R), accuracy after R rounds, the largest difference of the
   final model's logits on the job's probe images from our FedAvg's, and the load average.

Batch order (README.md, "Batch order"): `--batch-order own` (default) lets each side order its
batches itself; `engine` makes every side visit each client's samples in the order our engine
draws in that round (`orders.py` writes them; ours is checked to read exactly them); `in-order`
in stored order on every side (pfl-research's own). `--shuffle-seeds S ...` runs once per seed,
another draw of orders independent of --seed (data, split, schedule, initial weights).

`--device cuda` runs every side on the GPU with its own GPU settings: ours on JAX's GPU
backend, pfl-research's PyTorch backend on cuda (one process per GPU, the job's samples resident
on the GPU), Flower's clients with `num_gpus` = --flower-client-gpus (a fraction: several actors
share the GPU). The table's variant then reads e.g. "quiet, cuda", and the machine line names
the GPU. `--python-pfl PYTHON` / `--python-flower PYTHON` run that peer with an interpreter that
already has it (e.g. `python3` on a machine whose torch has CUDA) instead of making a venv.
Jobs are always prepared on XLA:CPU (JAX_PLATFORMS=cpu), so the initial weights and the probe
logits the PyTorch networks are checked against are the same on every machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PEERS = {"pfl": ["pfl"], "flower": ["flwr[simulation]"]}
RUNNERS = {"fedjax_pfl": "run_fedjax.py", "pfl-research": "run_pfl.py", "flower": "run_flower.py"}
VENV_OF = {"pfl-research": "pfl", "flower": "flower"}


def log(msg: str) -> None:
    print(f"[harness {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pip(python: str, *args: str) -> bool:
    cmd = [python, "-m", "pip", "install", "-q", *args]
    log(" ".join(cmd[2:]))
    return subprocess.run(cmd).returncode == 0


def ensure_venv(name: str, venv_dir: str, torch_wheel: str | None) -> str:
    """The venv's python, creating and installing it first if needed; says where torch came from."""
    root = os.path.join(venv_dir, name)
    python = os.path.join(root, "bin", "python")
    marker = os.path.join(root, "peers-install.json")
    if os.path.exists(marker):
        info = json.load(open(marker))
        log(f"venv {name}: {root} (torch from {info['torch_from']})")
        return python
    subprocess.run([sys.executable, "-m", "venv", root], check=True)
    if torch_wheel:
        ok, source = pip(python, torch_wheel), f"the wheel {torch_wheel}"
    else:
        ok, source = pip(python, "torch", "--index-url", CPU_INDEX), f"PyTorch's CPU index {CPU_INDEX}"
        if not ok:
            log("the CPU index failed; falling back to PyPI's torch (on Linux: the CUDA build)")
            ok, source = pip(python, "torch"), "PyPI's default torch"
    if not ok or not pip(python, *PEERS[name]):
        raise SystemExit(f"harness: could not install {name}'s environment in {root}")
    versions = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    torch_line = next((l for l in versions.splitlines() if l.lower().startswith("torch")), "?")
    source = f"{source}: {torch_line}"       # what is installed (pip keeps a torch already there)
    json.dump({"torch_from": source, "freeze": versions.splitlines()}, open(marker, "w"), indent=1)
    log(f"venv {name}: installed; torch from {source}")
    return python


def generator_of(path: str) -> str | None:
    """The synthetic generator a prepared job was written with (None: before it was recorded)."""
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["meta"])).get("generator")


def prepare(job: str, rounds: int, seed: int, smoke: bool, work: str) -> str:
    """The job's .npz in `work`, written by prepare.py unless there already, with the current
    synthetic generator (prepare.GENERATOR: a job written by an older one is written again)."""
    path = os.path.join(work, f"{'smoke_' if smoke else ''}{job}_r{rounds}_s{seed}.npz")
    from prepare import GENERATOR as current  # (prepare.py imports only NumPy at the top)

    if os.path.exists(path) and generator_of(path) != current:
        log(f"{path}: written by another synthetic generator; preparing it again ({current})")
        os.remove(path)
    if not os.path.exists(path):
        cmd = [sys.executable, os.path.join(HERE, "prepare.py"), job, "--rounds", str(rounds),
               "--seed", str(seed), "--out", path] + (["--smoke"] if smoke else [])
        # On XLA:CPU whatever the machine: exact float32 logits for the PyTorch networks' check
        # (a GPU's default matmul precision may be TF32) and the same initial weights everywhere.
        subprocess.run(cmd, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return path


def order_settings(args, job: str, path: str) -> list[tuple[str, dict]]:
    """(tag, extra runner arguments per framework) of every batch order to run on `job`:
    --batch-order own gives each side its own order (with --shuffle-seeds: ours and Flower
    shuffle with each seed; pfl-research has only its stored order); engine and in-order write
    one orders file per seed (orders.py, on XLA:CPU) that every side reads."""
    seeds = args.shuffle_seeds or [None]
    if args.batch_order == "in-order":
        seeds = [None]
    out = []
    for s in seeds:
        seed_tag = "" if s is None else f", shuffle seed {s}"
        if args.batch_order == "own":
            extra = {} if s is None else {"fedjax_pfl": ["--shuffle-seed", str(s)],
                                          "flower": ["--shuffle-seed", str(s)]}
            out.append(("" if s is None else f"own order{seed_tag}", extra))
            continue
        stem = os.path.splitext(path)[0]
        file = f"{stem}.orders-{args.batch_order}{'' if s is None else f'-s{s}'}-r{args.rounds}.npz"
        cmd = [sys.executable, os.path.join(HERE, "orders.py"), path, "--rounds", str(args.rounds),
               "--batch-order", args.batch_order, "--out", file]
        if s is not None:
            cmd += ["--shuffle-seed", str(s)]
        subprocess.run(cmd, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        name = {"engine": "engine order", "in-order": "stored order"}[args.batch_order]
        out.append((f"{name}{seed_tag}", {fw: ["--orders", file] for fw in RUNNERS}))
    return out


def side_list(args, variant: str) -> list[tuple[str, str, dict]]:
    """(label, framework, options) of every side run in `variant`."""
    sides = [("fedjax_pfl fedavg", "fedjax_pfl", {"algo": "fedavg"})]
    if "pgfedmo" in args.algos and args.batch_order == "own":       # (orders files: FedAvg's keys)
        sides.append(("fedjax_pfl pgfedmo", "fedjax_pfl", {"algo": "pgfedmo"}))
    if variant == "contended" and args.device == "cpu":       # XLA:CPU device counts
        for d in args.contended_devices:
            sides.append((f"fedjax_pfl fedavg, {d} XLA device{'s' * (d > 1)}", "fedjax_pfl",
                          {"algo": "fedavg", "devices": d}))
    sides += [("pfl-research fedavg", "pfl-research", {}), ("flower fedavg", "flower", {})]
    return [s for s in sides if s[1] in args.frameworks]


def run_side(framework: str, opts: dict, job_path: str, rounds: int, pythons: dict, args,
             extra: list[str] = ()) -> dict:
    cmd = [pythons[framework], os.path.join(HERE, RUNNERS[framework]), job_path, "--rounds", str(rounds),
           "--device", args.device, *extra]
    if framework == "fedjax_pfl":
        cmd += ["--algo", opts["algo"]]
        if opts.get("devices"):
            cmd += ["--devices", str(opts["devices"])]
        cmd += ["--state-placement", args.state_placement, "--chunk-size", str(args.chunk_size),
                "--memory-margin", repr(args.memory_margin)]
    elif framework == "pfl-research":
        cmd += ["--threads", str(args.threads)]
    else:
        cmd += ["--client-cpus", str(args.flower_client_cpus), "--client-gpus", str(args.flower_client_gpus)]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", FLWR_TELEMETRY_ENABLED="0",
               RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", PEERS_LAUNCH_T=repr(time.time()))
    env.pop("XLA_FLAGS", None)                 # the engine's device count comes from --devices
    env.pop("FEDJAX_PFL_CPU_DEVICES", None)
    load = common.loadavg()
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t0
    lines = [l for l in proc.stdout.splitlines() if l.startswith(common.RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"harness: {framework} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(common.RESULT_TAG):])
    result.update(wall_s=wall, load_before=load)
    if "skipped" in result:
        log(f"{framework} {opts}: skipped: {result['skipped']}")
    return result


def steady(result: dict) -> float:
    rounds = result["round_s"][1:] or result["round_s"]
    return statistics.median(rounds)


def ms_per_step(result: dict) -> float:
    pairs = list(zip(result["round_s"], result["steps"]))
    pairs = pairs[1:] or pairs
    return statistics.median(1e3 * t / max(n, 1) for t, n in pairs)


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def check_steps(results: list[dict]) -> None:
    """Every side of a job must take the same local steps in every round."""
    by_job: dict = {}
    for r in results:
        by_job.setdefault(r["job"], []).append(r)
    for job, rs in by_job.items():
        ref = rs[0]["steps"]
        for r in rs:
            expected = r.get("expected_steps")
            if r["steps"] != ref or (expected is not None and expected != r["steps"]):
                raise SystemExit(
                    f"harness: REFUSED — on {job}, {r['label']} took {r['steps']} local steps per "
                    f"round, {rs[0]['label']} {ref}: the sides did not do the same work")


def logit_gap(r: dict, results: list[dict]) -> float | None:
    """max |final logit − our FedAvg's| on the job's probe images, against our FedAvg run of the
    same job, variant and repeat (None where either has no logits)."""
    ours = [b for b in results if (b["job"], b["variant"], b.get("repeat"), b["label"]) ==
            (r["job"], r["variant"], r.get("repeat"), "fedjax_pfl fedavg")]
    if not ours or r.get("probe_logits") is None or ours[0].get("probe_logits") is None:
        return None
    import numpy as np

    return float(np.max(np.abs(np.asarray(r["probe_logits"]) - np.asarray(ours[0]["probe_logits"]))))


def table(results: list[dict]) -> str:
    rows = ["| job | variant | side | start-up s | round 1 s | steady s/round | ms/step | "
            "time ÷ our FedAvg's | accuracy | max abs Δlogit vs our FedAvg | steps/round | "
            "load (1-min) |", "|" + "---|" * 12]
    keys = []
    for r in results:
        k = (r["job"], r["variant"], r["label"])
        if k not in keys:
            keys.append(k)
    for job, variant, label in keys:
        rs = [r for r in results if (r["job"], r["variant"], r["label"]) == (job, variant, label)]
        base = [r for r in results if (r["job"], r["variant"], r["label"]) == (job, variant, "fedjax_pfl fedavg")]
        ratio = "–"
        if base and label != "fedjax_pfl fedavg":
            ratio = f"{statistics.median(steady(r) for r in rs) / statistics.median(steady(b) for b in base):.2f}×"
        loads = [r["load_before"][0] for r in rs] + [r["load_end"][0] for r in rs]
        gaps = [g for g in (logit_gap(r, results) for r in rs) if g is not None]
        gap = "–" if label == "fedjax_pfl fedavg" or not gaps else spread(gaps, "{:.2g}")
        rows.append(
            f"| {job} | {variant} | {label} | {spread([r['startup_s'] for r in rs], '{:.1f}')} | "
            f"{spread([r['round_s'][0] for r in rs])} | {spread([steady(r) for r in rs])} | "
            f"{spread([ms_per_step(r) for r in rs])} | {ratio} | "
            f"{spread([100 * r['accuracy'] for r in rs])} % | {gap} | {'/'.join(str(n) for n in rs[0]['steps'])} | "
            f"{min(loads):.2f}–{max(loads):.2f} |")
    return "\n".join(rows)


def machine() -> str:
    model = platform.processor() or "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    gpus = ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            gpus = "; GPU " + " | ".join(l.strip() for l in out.stdout.strip().splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{model}, {os.cpu_count()} cores{gpus}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="+", default=["pgfed", "cifar10"], choices=("pgfed", "cifar10"))
    parser.add_argument("--frameworks", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument("--algos", nargs="+", default=["fedavg", "pgfedmo"],
                        help="fedjax_pfl's algorithms (the peers run FedAvg)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (default 5; pfl's benchmark: 1,500)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--variants", nargs="+", default=["quiet", "contended"], choices=("quiet", "contended"))
    parser.add_argument("--burners", type=int, default=1, help="CPU-burning neighbours in 'contended' (default 1)")
    parser.add_argument("--contended-devices", type=int, nargs="*", default=[1],
                        help="extra fedjax_pfl FedAvg runs with this many XLA devices when contended (default 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="pfl-research's torch threads (default: cores)")
    parser.add_argument("--flower-client-cpus", type=float, default=2.0,
                        help="Ray num_cpus per Flower client (default 2)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where every side trains: cpu (default) or cuda (each framework's GPU settings)")
    parser.add_argument("--flower-client-gpus", type=float, default=0.25,
                        help="Ray num_gpus per Flower client with --device cuda (default 0.25)")
    parser.add_argument("--python-pfl", metavar="PYTHON",
                        help="run pfl-research with this interpreter (it has pfl and torch) instead of a venv")
    parser.add_argument("--python-flower", metavar="PYTHON",
                        help="run Flower with this interpreter (it has flwr[simulation] and torch) instead of a venv")
    parser.add_argument("--state-placement", default="auto", choices=("auto", "device", "host"),
                        help="fedjax_pfl's client state placement (run_fedjax.py; default auto: on "
                             "the devices unless the plan does not fit, e.g. PGFedMo on cifar10)")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="fedjax_pfl's clients per vectorised chunk (default 0: automatic)")
    parser.add_argument("--memory-margin", type=float, default=0.5,
                        help="fedjax_pfl runs only if planned within this share of the available "
                             "memory (default 0.5)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the job's seed: data, split, schedule, initial weights, and our and "
                             "Flower's batch orders unless --shuffle-seeds (default 0)")
    parser.add_argument("--batch-order", default="own", choices=("own", "engine", "in-order"),
                        help="own (default): each side its own (ours and Flower shuffle every epoch, "
                             "pfl-research in stored order); engine: every side visits each client's "
                             "samples in the order our engine draws in that round (orders.py writes "
                             "them, ours is checked to use them); in-order: every side in stored order. "
                             "engine and in-order run our FedAvg only")
    parser.add_argument("--shuffle-seeds", type=int, nargs="*", default=[],
                        help="run once per seed: another draw of batch orders, independent of --seed "
                             "(own: ours and Flower reshuffle, pfl-research unchanged; engine: the "
                             "engine's orders under keys folded with the seed)")
    parser.add_argument("--smoke", action="store_true",
                        help="one round on tiny data, quiet only: do all three still run?")
    parser.add_argument("--venv-dir", default=os.path.join(HERE, ".venvs"))
    parser.add_argument("--work-dir", default=os.path.join(HERE, "work"))
    parser.add_argument("--torch-wheel", default=os.environ.get("PEERS_TORCH_WHEEL"),
                        help="a torch wheel for the peers' venvs (default $PEERS_TORCH_WHEEL, else the CPU index)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run (default 3600)")
    parser.add_argument("--report", metavar="JSONL",
                        help="only print the table (and the step check) of the runs recorded in JSONL")
    parser.add_argument("--json", help="append every run's raw result here (default WORK/results.jsonl)")
    args = parser.parse_args(argv)
    if args.report:
        results = [json.loads(l) for l in open(args.report) if l.strip()]
        skipped = {f"{r['job']}: {r['label']}": r["skipped"] for r in results if "skipped" in r}
        results = [r for r in results if "skipped" not in r]
        check_steps(results)
        print(table(results))
        for what, why in skipped.items():
            print(f"not run: {what}: {why}")
        print(f"\nlocal steps per round equal on every side (checked); {len(results)} runs from {args.report}")
        return 0
    if args.smoke:
        args.rounds, args.repeats, args.variants = 1, 1, ["quiet"]
    os.makedirs(args.work_dir, exist_ok=True)
    out_json = args.json or os.path.join(args.work_dir, "results.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)

    pythons = {"fedjax_pfl": sys.executable}
    given = {"pfl-research": args.python_pfl, "flower": args.python_flower}
    for fw in args.frameworks:
        if fw in VENV_OF and given[fw]:
            pythons[fw] = shutil.which(given[fw]) or given[fw]
            if os.sep in pythons[fw]:
                pythons[fw] = os.path.abspath(pythons[fw])
            log(f"{fw}: the interpreter {pythons[fw]} (no venv)")
        elif fw in VENV_OF:
            pythons[fw] = ensure_venv(VENV_OF[fw], args.venv_dir, args.torch_wheel)
    jobs = {j: prepare(j, args.rounds, args.seed, args.smoke, args.work_dir) for j in args.jobs}
    for j, path in jobs.items():
        log(f"job {j}: {path}; data {common.Job(path).meta['data_source']}")
    order_runs = {j: order_settings(args, j, path) for j, path in jobs.items()}
    if args.batch_order != "own" and "pgfedmo" in args.algos and "fedjax_pfl" in args.frameworks:
        log(f"--batch-order {args.batch_order}: our FedAvg only (the orders are FedAvg's)")
    log(f"machine: {machine()}; load {common.loadavg()}")

    results, skipped = [], {}
    for rep in range(args.repeats):
        for variant in args.variants:
            burners = []
            if variant == "contended":
                burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                           for _ in range(args.burners)]
                time.sleep(2)
            try:
                for job, path in jobs.items():
                    for tag, extra in order_runs[job]:
                        sides = side_list(args, variant)
                        k = rep % len(sides)
                        for label, fw, opts in sides[k:] + sides[:k]:       # rotated each repeat
                            r = run_side(fw, opts, path, args.rounds, pythons, args, extra.get(fw, []))
                            shown = variant if args.device == "cpu" else f"{variant}, {args.device}"
                            r.update(label=label, variant=f"{shown}, {tag}" if tag else shown,
                                     batch_order=tag or "own", device=args.device, repeat=rep,
                                     smoke=args.smoke)
                            if "skipped" in r:
                                skipped.setdefault(f"{job}: {label}", r["skipped"])
                                with open(out_json, "a") as f:
                                    f.write(json.dumps(r) + "\n")
                                continue
                            results.append(r)
                            with open(out_json, "a") as f:
                                f.write(json.dumps(r) + "\n")
                            mem = r["settings"].get("memory") if fw == "fedjax_pfl" else None
                            where = (f", client state on the {mem['state_placement']} (plan "
                                     f"{mem['planned_mb']:,.0f} MB)" if mem else "")
                            log(f"{job} {r['variant']} rep {rep + 1}: {label}: start-up {r['startup_s']:.1f} s, "
                                f"rounds {[round(t, 2) for t in r['round_s']]}, steps {r['steps']}, "
                                f"accuracy {100 * r['accuracy']:.2f} %, load {r['load_before'][0]}{where}")
            finally:
                for b in burners:
                    b.send_signal(signal.SIGTERM)
                    b.wait()
    check_steps(results)
    print(f"\nmachine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; rounds "
          f"{args.rounds}, repeats {args.repeats}; burners {args.burners} (contended); device {args.device}")
    for j, path in jobs.items():
        print(f"{j}: data {common.Job(path).meta['data_source']}")
    settings = {}
    for r in results:
        settings.setdefault(r["label"], r["settings"])
    for label, s in settings.items():
        print(f"{label}: {json.dumps(s)}")
    print()
    print(table(results))
    for what, why in skipped.items():
        print(f"not run, does not fit in this machine's memory: {what}: {why}")
    print(f"\nlocal steps per round equal on every side ({'smoke: ' if args.smoke else ''}checked); "
          f"raw results in {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
