"""Writes one federated job as an .npz that every framework's runner reads (repository env).

    python benchmarks/peers/prepare.py pgfed --rounds 5 --out work/pgfed.npz
    python benchmarks/peers/prepare.py cifar10 --rounds 5 --out work/cifar10.npz
    python benchmarks/peers/prepare.py pgfed --smoke --out work/smoke_pgfed.npz

Jobs:
  pgfed    PGFed's protocol: Fashion-MNIST (70,000 images, train and test merged as the paper's
           code does), 25 clients by the class-wise Dir(0.3) split with at least 40 samples per
           client (`fedjax_pfl.data.partition.dirichlet`), 75/25 train/test within each client,
           6 clients a round, E = 5 local epochs of batch 10, SGD lr 0.005 momentum 0.9, the
           FedAvg CNN (`--model cnn`).
  cifar10  pfl-research's CIFAR-10 benchmark (benchmarks/image_classification, config
           baseline.yaml, dataset cifar10_iid): 1,000 clients of 50 training images drawn IID
           from the 50,000, cohort 50, one local epoch of batch 10, client SGD lr 0.1 (no
           momentum), server SGD lr 1.0, their two-layer CNN (our `--model femnist_cnn`: conv 3×3
           32, conv 3×3 64, max-pool, dense 128, dense 10; dropout omitted everywhere, as the
           engine's models have no RNG). The 10,000 test images are split 10 per client, so the
           sample-weighted accuracy over clients is the central test accuracy.

Data: real files when `fedjax_pfl.data.load_raw` finds them (Fashion-MNIST: e.g. the Debian
package dataset-fashion-mnist; CIFAR-10: the python batches under $FEDJAX_PFL_DATA_DIR/cifar10),
otherwise synthetic images of the same shape, count and client sizes; `meta["data_source"]` says
which. The synthetic generator (`synthetic_images`, named by GENERATOR in `meta["generator"]`;
NumPy's generator seeded by --seed, so the same bytes every time): image i of class y is

    128 + a_i · roll(P_y, (dy_i, dx_i)) + 40 · (w_i @ B) + 24 · e_i,   clipped to 0..255,

P_c = own_c + 0.7 · own_{c+1 mod 10} rescaled to standard deviation SIGNAL = 33 grey levels (each
own_c a smooth random colour field: white noise low-passed by a Gaussian of 3 cycles per image,
per channel), contrast a_i ~ U(0.5, 1.5), a circular shift (dy_i, dx_i) uniform in [-4, 4]²,
clutter from 32 more smooth fields B shared by all classes with weights w_i ~ N(0, I/32), and
white noise e_i ~ N(0, 1) per pixel. A weak, shifted pattern, partly shared with the next class,
under stronger clutter of the same frequencies: fedjax_pfl's FedAvg on the cifar10 job reached
51 % after 5 rounds (43 % with SIGNAL = 28; both measured with the clutter product in float32,
which differs from this float64 one in 3e-6 of the pixels by one grey level), where the earlier
generator (a per-pixel pattern U(60, 196) plus N(0, 48) noise) gave every side ≥ 99.8 % after 4.
The pgfed job's synthetic
fallback and the --smoke jobs use the same generator at their shapes. `--smoke`: six clients of
20-odd samples, two a round, one epoch — seconds per framework.

Sampled clients: `schedule[r]` holds round r's M client ids (sorted), drawn here once with
NumPy's generator seeded by --seed; every runner trains exactly these clients.

Initial model: the engine's own initial parameters for --seed (`models.get(...).init(
fold_in(key(seed), 0))`, what `core.Program.init` gives FedAvg), saved as `param/<layer>/<name>`,
with the logits of 8 probe images, so the PyTorch runners load the same weights and check that
their network computes the same function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

JOBS = {
    "pgfed": dict(dataset="fashion_mnist", model="cnn", torch_model="fedavg_cnn", clients=25,
                  per_round=6, local_epochs=5, batch_size=10, lr=0.005, momentum=0.9,
                  server_lr=1.0, alpha=0.3, min_size=40, test_fraction=0.25, num_classes=10,
                  shape=(28, 28, 1), samples=70_000),
    "cifar10": dict(dataset="cifar10", model="femnist_cnn", torch_model="pfl_simple_cnn",
                    clients=1000, per_round=50, local_epochs=1, batch_size=10, lr=0.1,
                    momentum=0.0, server_lr=1.0, per_client=50, test_per_client=10,
                    num_classes=10, shape=(32, 32, 3), samples=60_000),
}


# The synthetic stand-in's generator (`synthetic_images`); its defaults are calibrated so that
# FedAvg on the cifar10 job is about half right after 5 rounds (51 %, README.md). A prepared job
# records GENERATOR in its meta; the harness prepares a job again when it differs.
GENERATOR = "smooth-shifted-1"
SIGNAL = 33.0          # class pattern's standard deviation (grey levels), scaled per image by U(0.5, 1.5)
OVERLAP = 0.7          # class c's pattern = own_c + OVERLAP · own_{c+1}, then rescaled
SHIFT = 4              # random circular shift of the pattern, up to ±SHIFT pixels each way
CLUTTER = 40.0         # standard deviation of a random mixture of 32 smooth fields, per image
NOISE = 24.0           # white Gaussian noise per pixel
SMOOTH = 3.0           # Gaussian low-pass of the fields: standard deviation in cycles per image


def smooth_fields(rng: np.random.Generator, k: int, shape: tuple, cutoff: float) -> np.ndarray:
    """[k, *shape] float32: white noise low-passed in space (a Gaussian of `cutoff` cycles per
    image, each channel separately), each field at zero mean and unit standard deviation."""
    h, w = shape[:2]
    z = rng.normal(size=(k, *shape))
    fy, fx = np.fft.fftfreq(h) * h, np.fft.fftfreq(w) * w
    gain = np.exp(-(fy[:, None] ** 2 + fx[None, :] ** 2) / (2 * cutoff ** 2))
    gain = gain.reshape(h, w, *([1] * (len(shape) - 2)))
    f = np.real(np.fft.ifft2(np.fft.fft2(z, axes=(1, 2)) * gain, axes=(1, 2)))
    f -= f.mean(axis=tuple(range(1, f.ndim)), keepdims=True)
    f /= f.std(axis=tuple(range(1, f.ndim)), keepdims=True)
    return f.astype(np.float32)


def synthetic_images(n: int, shape: tuple, num_classes: int, seed: int, *, signal: float = SIGNAL,
                     overlap: float = OVERLAP, shift: int = SHIFT, clutter: float = CLUTTER,
                     noise: float = NOISE, smooth: float = SMOOTH):
    """uint8 images [n, *shape] and balanced labels [n], deterministic in `seed`.

    Image i of class y: 128 + a_i · roll(P_y, (dy_i, dx_i)) + clutter · (w_i @ B) + noise · e_i,
    clipped to 0..255, where
      P_c = own_c + overlap · own_{(c+1) mod C}, rescaled to standard deviation `signal`: each class
            a smooth random colour pattern (`smooth_fields`) sharing part of the next class's;
      a_i ~ U(0.5, 1.5) (contrast), (dy_i, dx_i) uniform in [-shift, shift]² (circular shift);
      B     32 more smooth fields shared by all classes, w_i ~ N(0, I/32): structured clutter;
      e_i   white noise N(0, 1) per pixel.
    The class is in a weak, shifted, partly shared low-frequency pattern under stronger clutter
    of the same frequencies, so the job's CNN learns it gradually (not in one round)."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % num_classes).astype(np.int32)
    own = smooth_fields(rng, num_classes, shape, smooth)
    patterns = own + overlap * np.roll(own, -1, axis=0)
    patterns *= signal / patterns.std(axis=tuple(range(1, patterns.ndim)), keepdims=True)
    bank = smooth_fields(rng, 32, shape, smooth).reshape(32, -1).astype(np.float64)
    offsets = rng.integers(-shift, shift + 1, size=(n, 2))
    contrast = rng.uniform(0.5, 1.5, size=n)
    x = np.empty((n, *shape), np.uint8)
    # In float64 (the BLAS product too), so that other BLAS kernels round to the same bytes.
    for lo in range(0, n, 4096):                 # in blocks: ~100 MB of float64 at a time
        hi = min(n, lo + 4096)
        block = (clutter / np.sqrt(32)) * (rng.normal(size=(hi - lo, 32)) @ bank)
        block = block.reshape(hi - lo, *shape) + 128.0
        block += noise * rng.normal(size=block.shape)
        for i in range(lo, hi):
            block[i - lo] += contrast[i] * np.roll(patterns[y[i]], tuple(offsets[i]), axis=(0, 1))
        x[lo:hi] = np.clip(np.rint(block), 0, 255).astype(np.uint8)
    return x, y


def load(job: dict, smoke: bool, seed: int):
    """(x, y, scale, shift, source): the whole dataset, train split first for CIFAR-10."""
    from fedjax_pfl import data

    if not smoke:
        try:
            raw = data.load_raw(job["dataset"])
            return raw.x, raw.y.astype(np.int32), raw.input_scale, raw.input_shift, f"real: {raw.source}"
        except data.DatasetNotFoundError:
            pass
    n = 200 if smoke else job["samples"]
    x, y = synthetic_images(n, job["shape"], job["num_classes"], seed)
    why = "--smoke" if smoke else "no local copy found"
    return x, y, 2.0 / 255.0, -1.0, (f"synthetic ({why}): {n} images {job['shape']}, {GENERATOR}: "
                                      "shifted, overlapping class patterns under clutter and noise")


def split(name: str, job: dict, y: np.ndarray, smoke: bool, seed: int):
    """Per-client (train rows, test rows) of the loaded arrays."""
    from fedjax_pfl.data import partition

    rng = np.random.default_rng(seed)
    if smoke:
        order = rng.permutation(y.size)[:6 * 30]
        parts = np.array_split(order, 6)
        return [p[:22] for p in parts], [p[22:] for p in parts]
    if name == "pgfed":
        parts = partition.dirichlet(y, job["clients"], alpha=job["alpha"], seed=seed,
                                    min_size=job["min_size"])
        return partition.split_train_test(parts, test_fraction=job["test_fraction"], seed=seed)
    # cifar10: rows 0..49,999 are the training images, the rest the test images.
    n_train = job["clients"] * job["per_client"]
    train = rng.permutation(50_000)[:n_train].reshape(job["clients"], job["per_client"])
    test = (50_000 + rng.permutation(y.size - 50_000)).reshape(job["clients"], -1)
    return list(train), list(test)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", choices=sorted(JOBS))
    parser.add_argument("--rounds", type=int, default=5, help="rounds in the schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny synthetic data, 2 of 6 clients, E = 1")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import jax

    from fedjax_pfl import models

    job = dict(JOBS[args.job])
    if args.smoke:
        job.update(clients=6, per_round=2, local_epochs=1)
    x, y, scale, shift, source = load(job, args.smoke, args.seed)
    if args.job == "cifar10" and not args.smoke and y.size != 60_000:
        raise SystemExit(f"prepare.py: CIFAR-10 should have 60,000 images, found {y.size}")
    train, test = split(args.job, job, y, args.smoke, args.seed)
    blocks = [np.asarray(b, np.int64) for b in (*train, *test)]
    order = np.concatenate(blocks)
    n = len(train)
    rng = np.random.default_rng(args.seed + 1)
    schedule = np.stack([np.sort(rng.choice(n, job["per_round"], replace=False))
                         for _ in range(args.rounds)]).astype(np.int32)

    model = models.get(job["model"], x.shape[1:], job["num_classes"])
    params = model.init(jax.random.fold_in(jax.random.key(args.seed), 0))
    probe = x[order[:8]].astype(np.float32) * scale + shift
    logits = np.asarray(model.apply(params, probe))
    flat = {"param/" + "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}

    meta = dict(job, job=args.job, smoke=args.smoke, seed=args.seed, rounds=args.rounds,
                data_source=source, generator=GENERATOR, input_scale=float(scale), input_shift=float(shift),
                clients=n, shape=list(x.shape[1:]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez(args.out, x=x[order], y=y[order].astype(np.int32),
             train_counts=np.array([len(b) for b in train], np.int32),
             test_counts=np.array([len(b) for b in test], np.int32),
             schedule=schedule, meta=json.dumps(meta), probe_x=probe, probe_logits=logits, **flat)
    sizes = [len(b) for b in train]
    print(f"{args.job}: {n} clients, train sizes {min(sizes)}-{max(sizes)}, "
          f"{job['per_round']} a round, {args.rounds} rounds scheduled; data {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
