#!/usr/bin/env python
"""Personalised LoRA on clients whose text differs in style (docs/results/lora_styles.md).

    PYTHONPATH=. python docs/results/run_lora_styles.py            # ~ a few minutes on 2 CPUs
    PYTHONPATH=. python docs/results/run_lora_styles.py --rounds 20 --out /tmp/lora_styles

Nothing is downloaded. The script writes a JSON Lines file of synthetic clients (--out/
styles.jsonl, one {"client": ..., "text": ...} per line): S styles, each a first-order Markov
chain over one shared word list whose transition table is a mixture of a shared table and the
style's own (weight --style-strength), so a style is its own vocabulary distribution and its own
phrases; --clients-per-style clients write in each style. The base is a tiny RANDOM Llama
(`models.hf.decoder_from_config`, flax's initialisation): the page shows the mechanism (what
each algorithm keeps per client), not what adapters do to a pretrained model's quality.

Compared, each on LoRA adapters (r = 4, α = 8 on q_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj), the base frozen: FedAvg (one global adapter, FedIT), FedRep with the adapters'
head (lora_B personal, lora_A shared and averaged: FedSA-LoRA's split) and Ditto (a personal
adapter per client, proximal to the global one). Reported: each client's next-token test loss
and accuracy on its own held-out sequences, from the model the algorithm would give that client
(FedAvg: the global adapter; FedRep, Ditto: the personal one), and the mean.

For a real base and Shakespeare's characters (TFF's files, a local folder):
    python -m experiments.run --model hf:/models/SmolLM2-135M --peft lora --lora-rank 8 \
        --lora-alpha 16 --lora-targets q_proj,v_proj --dataset shakespeare --data-dir DIR \
        --algo fedrep --rounds 50
(the flags of issue 59; where a checkout lacks them, `models.hf.model_from_hf` + `lora.lora` +
`core.Program` as below.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def styles_jsonl(path: str, *, styles: int, per_style: int, sequences: int, words: int,
                 length: int, strength: float, seed: int) -> list[tuple[str, list[list[int]]]]:
    """Writes the JSONL; returns [(client id, [word ids of each sequence])]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(words)]
    shared = rng.dirichlet(np.full(words, 0.5), size=words)
    own = [rng.dirichlet(np.full(words, 0.05), size=words) for _ in range(styles)]
    clients = []
    with open(path, "w") as f:
        for s in range(styles):
            table = (1 - strength) * shared + strength * own[s]
            start = rng.dirichlet(np.full(words, 0.1))
            for c in range(per_style):
                cid = f"style{s}_client{c}"
                seqs = []
                for _ in range(sequences):
                    w = [rng.choice(words, p=start)]
                    for _ in range(length - 1):
                        w.append(rng.choice(words, p=table[w[-1]]))
                    seqs.append(w)
                    f.write(json.dumps({"client": cid, "text": " ".join(vocab[i] for i in w)})
                            + "\n")
                clients.append((cid, seqs))
    return clients


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/lora_styles")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--styles", type=int, default=4)
    p.add_argument("--clients-per-style", type=int, default=3)
    p.add_argument("--sequences", type=int, default=24, help="per client (a quarter are test)")
    p.add_argument("--words", type=int, default=48)
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--style-strength", type=float, default=0.7)
    p.add_argument("--algos", nargs="+", default=["fedavg", "fedrep", "ditto"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--local-epochs", type=int, default=2)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    sys.path.insert(0, ROOT)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedjax_pfl import algorithms, core
    from fedjax_pfl.data import FederatedData, Task
    from fedjax_pfl.models import hf, lora
    from fedjax_pfl.models.model import Model

    clients = styles_jsonl(os.path.join(a.out, "styles.jsonl"), styles=a.styles,
                           per_style=a.clients_per_style, sequences=a.sequences, words=a.words,
                           length=a.length, strength=a.style_strength, seed=a.seed)
    # Token ids = word ids (the JSONL's words are w0 … w{V−1}); labels by the pretrained contract.
    V, T = a.words, a.length
    x, train, test, n = [], [], [], 0
    n_test = a.sequences // 4
    for _, seqs in clients:
        x += seqs
        train.append(np.arange(n, n + len(seqs) - n_test))
        test.append(np.arange(n + len(seqs) - n_test, n + len(seqs)))
        n += len(seqs)
    x = np.asarray(x, np.int32)
    y = hf.shifted_labels(x)
    task = Task(kind="sequence", num_classes=V, inputs="tokens", vocab_size=V,
                default_model="transformer", label_offset=1)
    data = FederatedData.from_arrays(x, y, train, test, num_classes=V, task=task)

    dec = hf.decoder_from_config({
        "model_type": "llama", "vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 64, "tie_word_embeddings": True, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6})
    base = dec.module.init(jax.random.key(a.seed), jnp.zeros((1, T), jnp.int32))["params"]
    model = Model(init=lambda key: base, apply=dec.apply, loss=hf.shifted_sequence_loss,
                  name="random-llama", weight=hf.shifted_sequence_weight,
                  metric=hf.shifted_sequence_metric)
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted, _ = lora.lora(model, base, jnp.zeros((1, T), jnp.int32), targets=targets, rank=4,
                           alpha=8.0)
    common = dict(participation=0.5, batch_size=6, lr=a.lr, local_epochs=a.local_epochs)
    extra = {"fedavg": {}, "fedrep": {"head": "head"}, "ditto": {"lam": 0.1}}
    results = {}
    for name in a.algos:
        algo = algorithms.get(name, model=adapted, **common, **extra.get(name, {}))
        program = core.Program(algo, data, mesh=None)
        state = program.init(jax.random.key(a.seed))
        state, _ = program.run_rounds(state, jax.random.key(a.seed + 1), 0, a.rounds)
        ev = program.evaluate(state)["client"]
        loss = np.asarray(ev.loss_sum) / np.asarray(ev.loss_count if ev.loss_count is not None
                                                     else ev.count)
        acc = np.asarray(ev.correct) / np.asarray(ev.count)
        results[name] = {"loss": loss.tolist(), "accuracy": acc.tolist()}
        print(f"{name:<7} mean test loss {loss.mean():.3f}  accuracy {acc.mean():.3f}", flush=True)
    # The base alone (B = 0 everywhere: the adapters' initial state).
    zero = core.Program(algorithms.get("fedavg", model=adapted, **common), data, mesh=None)
    ev = zero.evaluate(zero.init(jax.random.key(a.seed)))["client"]
    results["base"] = {"loss": (np.asarray(ev.loss_sum) / np.asarray(ev.loss_count)).tolist(),
                       "accuracy": (np.asarray(ev.correct) / np.asarray(ev.count)).tolist()}
    names = [c for c, _ in clients]
    cols = ["base", *a.algos]
    print("\n| client | " + " | ".join(f"{c} loss / acc" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for i, cid in enumerate(names):
        print(f"| {cid} | " + " | ".join(
            f"{results[c]['loss'][i]:.3f} / {results[c]['accuracy'][i]:.3f}" for c in cols) + " |")
    print("| **mean** | " + " | ".join(
        f"**{np.mean(results[c]['loss']):.3f} / {np.mean(results[c]['accuracy']):.3f}**"
        for c in cols) + " |")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"clients": names, **results}, f, indent=1)


if __name__ == "__main__":
    main()
