#!/usr/bin/env python
"""LoRA cohorts: the engine's vectorised cohort of adapters against a PyTorch + PEFT loop over
clients, on identical work (issue 59 item 5).

    python benchmarks/lora_cohort.py                              # cohorts 4 16 64, 2 repeats
    python benchmarks/lora_cohort.py --cohorts 4 16 --repeats 1   # quicker
    python benchmarks/lora_cohort.py --model-dir /models/SmolLM2-135M --cohorts 16 64 256 \
        --seq-len 256 --chunk-size 0                              # a real folder, e.g. on a GPU

The model: a Hugging Face folder (config.json + model.safetensors). Without --model-dir a tiny
Llama is written once by `transformers` `save_pretrained` (--hidden 256, 4 layers, 8 heads, 4 kv
heads, intermediate 704, vocabulary 2048, tied embeddings: about 3.5 M parameters) under
--work-dir; both sides read that same folder: ours with `fedjax_pfl.models.hf.model_from_hf`,
theirs with `LlamaForCausalLM.from_pretrained`.

The work, the same on both sides: LoRA r = --rank, α = --alpha on --targets (q_proj,v_proj),
float32; M clients, each from the same global adapter, K = --local-steps plain SGD steps
(lr 0.01) of B × T random tokens (next-token loss over T − 1 positions); the M adapters are
summed/averaged at the end (FedAvg's round).
  ours    FedAvg (`algorithms.get("fedavg")`) on `lora.lora(model_from_hf(...))` through
          `core.Program`: one compiled round trains the M adapters as one stacked pytree over one
          copy of the frozen base (--chunk-size clients at a time; 0: all M in one vmap). Timed:
          steady rounds after `Program.compile` and one warm-up round.
  theirs  one `PeftModel` over the base; per client `set_peft_model_state_dict(global)`, a
          fresh `torch.optim.SGD`, K steps, `get_peft_model_state_dict` summed (the peers'
          loop: pfl-research's benchmarks/llm, FlowerTune). OMP_WAIT_POLICY=PASSIVE,
          torch.set_num_threads(--threads). One warm-up round, then timed rounds.
Each (side, cohort, repeat) runs in its own process, interleaved (ours, theirs, ours, ...), so
a noisy neighbour hits both. Reported: client-steps/s (M·K over the round's seconds; the median
over --rounds, then the median over --repeats) each and ours/theirs.

Memory per extra client: XLA's memory analysis (temp + output + argument bytes) of our compiled
round at the two smallest cohorts, fully vmapped (chunk = M), difference / ΔM; against a hand
count per client: its adapter (leaves' sizes), its gradient and the SGD update (same size
each; plain SGD keeps no optimizer state), its B × T tokens and labels, and the activations
the backward pass keeps (per layer and token: the listed intermediates of a Llama block; per
sequence the attention's probabilities; the logits and their softmax), printed term by term.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def make_folder(path: str, a) -> None:
    """The tiny Llama of the defaults, written by transformers (random weights, seed 0)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        intermediate_size=a.intermediate, max_position_embeddings=max(512, a.seq_len),
        tie_word_embeddings=True, rope_theta=10000.0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def tokens(M: int, K: int, B: int, T: int, vocab: int, seed: int = 0):
    import numpy as np
    return np.random.default_rng(seed).integers(0, vocab, (M, K, B, T), dtype=np.int64)


# ---------------------------------------------------------------------------------- ours

def ours(a, M: int, chunk: int, analyse_only: bool = False) -> dict:
    sys.path.insert(0, ROOT)
    import fedjax_pfl

    if a.cpu_devices:
        fedjax_pfl.use_cpu_cores()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedjax_pfl import algorithms, core
    from fedjax_pfl.data import FederatedData, Task
    from fedjax_pfl.models import hf, lora

    K, B, T = a.local_steps, a.batch_size, a.seq_len
    model = hf.model_from_hf(a.model_dir)
    base = model.init(jax.random.key(0))
    cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    V = int(cfg["vocab_size"])
    adapted, lcfg = lora.lora(model, base, jnp.zeros((1, T), jnp.int32),
                              targets=a.targets.split(","), rank=a.rank, alpha=a.alpha)
    toks = tokens(M, K, B, T, V).reshape(M * K * B, T)
    x = np.concatenate([toks, toks[: M * B]]).astype(np.int32)     # test rows: unused here
    y = hf.shifted_labels(x)
    train = [np.arange(i * K * B, (i + 1) * K * B) for i in range(M)]
    test = [M * K * B + np.arange(i * B, (i + 1) * B) for i in range(M)]
    task = Task(kind="sequence", num_classes=V, inputs="tokens", vocab_size=V,
                default_model="transformer", label_offset=1)
    data = FederatedData.from_arrays(x, y, train, test, num_classes=V, task=task)
    algo = algorithms.get("fedavg", model=adapted, participation=1.0, batch_size=B, lr=0.01,
                          local_steps=K, backend="chunked", chunk_size=chunk or M)
    program = core.Program(algo, data, mesh=None)
    keys = jax.random.key(1)
    compile_s = program.compile(keys)
    mem = program._round_compiled.memory_analysis()
    cost = program._round_compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # (XLA counts a loop's body once: with the whole cohort in one chunk the round's count is
    # one local step of every client, so /M is a client-step's arithmetic)
    step_flops = float(cost.get("flops", float("nan"))) / M if chunk in (0, M) else float("nan")
    out = {"side": "ours", "M": M, "chunk": chunk or M, "compile_s": compile_s,
           "temp_bytes": int(mem.temp_size_in_bytes), "arg_bytes": int(mem.argument_size_in_bytes),
           "out_bytes": int(mem.output_size_in_bytes),
           "client_step_flops": step_flops,
           "adapter_floats": int(sum(np.size(v) for v in jax.tree.leaves(adapted.init(keys)))),
           "base_params": int(sum(np.size(v) for v in jax.tree.leaves(base)))}
    if analyse_only:
        return out
    state = program.init(jax.random.key(0))
    times = []
    for r in range(a.rounds + 1):
        t0 = time.perf_counter()
        state, metrics = program.run_rounds(state, keys, r, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        steps = int(np.sum(metrics[0]["client_steps"]))
    assert steps == M * K, (steps, M, K)
    out.update(times=times[1:], client_steps_per_s=M * K / statistics.median(times[1:]),
               loss=float(np.mean(metrics[0]["train_loss"])))
    return out


# -------------------------------------------------------------------------------- theirs

def theirs(a, M: int) -> dict:
    import peft
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    K, B, T = a.local_steps, a.batch_size, a.seq_len
    base = transformers.LlamaForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    lcfg = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=a.targets.split(","),
                           lora_dropout=0.0, task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lcfg)
    model.train()
    data = torch.from_numpy(tokens(M, K, B, T, base.config.vocab_size))
    glob = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    times, loss = [], 0.0
    for r in range(a.rounds + 1):
        t0 = time.perf_counter()
        total = None
        for c in range(M):
            peft.set_peft_model_state_dict(model, glob)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
            for k in range(K):
                ids = data[c, k]
                out = model(input_ids=ids, labels=ids)   # HF shifts: T − 1 positions scored
                opt.zero_grad()
                out.loss.backward()
                opt.step()
                loss = float(out.loss)
            sd = peft.get_peft_model_state_dict(model)
            total = ({k: v.detach().clone() for k, v in sd.items()} if total is None
                     else {k: total[k] + sd[k].detach() for k in total})
        glob = {k: v / M for k, v in total.items()}
        times.append(time.perf_counter() - t0)
    return {"side": "theirs", "M": M, "times": times[1:], "loss": loss,
            "client_steps_per_s": M * K / statistics.median(times[1:])}


# ----------------------------------------------------------------------------- the hand count

def hand_count(a, cfg: dict, adapter_floats: int) -> dict[str, int]:
    """Bytes per extra client (float32), by hand; see the module docstring."""
    B, T = a.batch_size, a.seq_len
    D, L, I, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = D // H
    # Kept for the backward pass per token and layer: the two RMSNorm inputs and outputs (4D),
    # q, k, v (D + 2·KV·hd) and their rotated q, k (D + KV·hd), the attention output and o_proj's
    # (2D), gate, up, silu(gate), their product (4I), the LoRA inputs' rank-r projections
    # (2 targets × r).
    per_token_layer = 4 * D + (D + 2 * KV * hd) + (D + KV * hd) + 2 * D + 4 * I + 2 * a.rank
    acts = 4 * L * B * T * per_token_layer
    attn = 4 * L * B * H * T * T * 2                 # scores and probabilities, per head
    logits = 4 * B * T * V * 2                       # logits and their softmax (the loss)
    return {"adapter": 4 * adapter_floats, "gradient + update": 2 * 4 * adapter_floats,
            "optimizer state (plain SGD)": 0, "tokens + labels": 2 * 4 * B * T,
            "activations (blocks)": acts, "attention probabilities": attn,
            "logits + softmax": logits}


# ---------------------------------------------------------------------------------- driver

def child(a) -> None:
    if a.child == "ours":
        row = ours(a, a.M, a.chunk_size, analyse_only=a.analyse_only)
    else:
        row = theirs(a, a.M)
    print("ROW " + json.dumps(row), flush=True)


def spawn(a, side: str, M: int, extra=()) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--M", str(M), *base_argv(a), *extra]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": ROOT,
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if proc.returncode or not rows:
        raise SystemExit(f"{side} M={M} failed:\n{proc.stderr[-3000:]}")
    return json.loads(rows[-1])


def base_argv(a) -> list[str]:
    return ["--model-dir", a.model_dir, "--local-steps", str(a.local_steps), "--batch-size",
            str(a.batch_size), "--seq-len", str(a.seq_len), "--rank", str(a.rank), "--alpha",
            str(a.alpha), "--targets", a.targets, "--rounds", str(a.rounds), "--threads",
            str(a.threads), "--chunk-size", str(a.chunk_size),
            *(["--cpu-devices"] if a.cpu_devices else [])]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--cohorts", type=int, nargs="+", default=[4, 16, 64], help="M values")
    p.add_argument("--repeats", type=int, default=2, help="processes per (side, M), interleaved")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per process (after one)")
    p.add_argument("--local-steps", type=int, default=2, help="K, local SGD steps per client")
    p.add_argument("--batch-size", type=int, default=8, help="B, sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="T, tokens per sequence")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--chunk-size", type=int, default=16,
                   help="our clients per vmapped chunk (0: the whole cohort at once)")
    p.add_argument("--cpu-devices", action="store_true",
                   help="ours: split the cohort over one XLA device per core (use_cpu_cores)")
    p.add_argument("--model-dir", default=None,
                   help="a Hugging Face Llama folder (default: the tiny one under --work-dir)")
    p.add_argument("--work-dir", default="/tmp/lora_cohort")
    p.add_argument("--skip-torch", action="store_true", help="ours only (e.g. on a GPU box)")
    p.add_argument("--json", default=None, help="append the rows to this JSON Lines file")
    # internal
    p.add_argument("--child", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    p.add_argument("--M", type=int, help=argparse.SUPPRESS)
    p.add_argument("--analyse-only", action="store_true", help=argparse.SUPPRESS)
    # tiny model's shape
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--vocab", type=int, default=2048)
    a = p.parse_args(argv)
    if a.child:
        return child(a)
    if a.model_dir is None:
        a.model_dir = os.path.join(a.work_dir, "llama_tiny")
        if not os.path.exists(os.path.join(a.model_dir, "config.json")):
            make_folder(a.model_dir, a)
    cfg = json.load(open(os.path.join(a.model_dir, "config.json")))
    rows: list[dict] = []
    res: dict[tuple[str, int], list[float]] = {}
    for M in a.cohorts:
        for rep in range(a.repeats):
            for side in ("ours", "theirs"):
                if side == "theirs" and a.skip_torch:
                    continue
                row = spawn(a, side, M)
                row["repeat"] = rep
                rows.append(row)
                res.setdefault((side, M), []).append(row["client_steps_per_s"])
                print(f"  {side:<6} M={M:<4} rep {rep}: {row['client_steps_per_s']:8.2f} "
                      f"client-steps/s  rounds {[round(t, 2) for t in row['times']]} s", flush=True)
    flops = next((r["client_step_flops"] for r in rows if r.get("client_step_flops", 0) > 0),
                 float("nan"))
    print(f"\none client-step: {flops / 1e9:.3f} GFLOP (XLA's count of our round; the same work "
          "on both sides)")
    print(f"{'M':>4} {'ours client-steps/s':>20} {'PEFT loop':>10} {'ratio':>6} "
          f"{'ours GFLOP/s':>13} {'loop GFLOP/s':>13}")
    for M in a.cohorts:
        o = statistics.median(res[("ours", M)])
        t = statistics.median(res[("theirs", M)]) if ("theirs", M) in res else float("nan")
        print(f"{M:>4} {o:>20.2f} {t:>10.2f} {o / t:>6.2f} {o * flops / 1e9:>13.1f} "
              f"{t * flops / 1e9:>13.1f}")
    # Memory per extra client: the two smallest cohorts, fully vmapped.
    m1, m2 = sorted(a.cohorts)[:2]
    an = [spawn(a, "ours", m, ["--analyse-only", "--chunk-size", "0"]) for m in (m1, m2)]
    tot = [r["temp_bytes"] + r["out_bytes"] + r["arg_bytes"] for r in an]
    per = (tot[1] - tot[0]) / (m2 - m1)
    temp = (an[1]["temp_bytes"] - an[0]["temp_bytes"]) / (m2 - m1)
    hand = hand_count(a, cfg, an[0]["adapter_floats"])
    print(f"\nbase parameters {an[0]['base_params']:,}; adapter {an[0]['adapter_floats']:,} floats")
    print(f"XLA round at M={m1}: {tot[0] / 2**20:.1f} MiB, M={m2}: {tot[1] / 2**20:.1f} MiB "
          f"(temp + arguments + outputs); per extra client {per / 2**20:.2f} MiB "
          f"(temp alone {temp / 2**20:.2f} MiB)")
    print("hand count per client:")
    for k, v in hand.items():
        print(f"  {k:<28} {v / 2**20:8.3f} MiB")
    print(f"  {'total':<28} {sum(hand.values()) / 2**20:8.3f} MiB")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows + an:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
