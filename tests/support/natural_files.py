"""Small natural-client datasets written in their real file layouts, with a signal a model can
learn in a few rounds (for end-to-end runs; the readers' own tests check the layouts in detail).

LEAF: `DIR/train/*.json` and `DIR/test/*.json` (users, num_samples, user_data{x, y}).
TFF: `DIR/<name>_train.h5` / `_test.h5` with groups examples/<client>/<feature>, and Stack
Overflow's word and tag count files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LEAF_LETTERS = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}")


def _leaf_split(root: Path, split: str, users: dict[str, tuple[list, list]], shards: int = 2):
    names = sorted(users)
    for s in range(shards):
        mine = names[s::shards]
        data = {"users": mine, "num_samples": [len(users[u][1]) for u in mine],
                "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in mine}}
        path = root / split / f"all_data_{s}_niid_0_keep_0_{split}_9.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))


def leaf_femnist(root: Path, clients: int = 4, n: int = 24, seed: int = 0) -> list[str]:
    """FEMNIST-like: class c lights up row band c % 7 (LEAF stores grey/255, background 1.0)."""
    rng = np.random.default_rng(seed)
    ids = [f"f{i:04d}_{i % 10:02d}" for i in range(clients)]
    for split, count in (("train", n), ("test", n // 3)):
        users = {}
        for u in ids:
            y = rng.integers(0, 7, count)
            img = np.ones((count, 28, 28)) - 0.1 * rng.random((count, 28, 28))
            for j, c in enumerate(y):
                img[j, 4 * c:4 * c + 4, :] = 0.0
            users[u] = ((np.round(img.reshape(count, 784) * 255) / 255).tolist(), y.tolist())
        _leaf_split(root, split, users)
    return ids


def _text(rng, length: int) -> str:
    """A periodic text with a few random letters: the next character is mostly predictable."""
    base = "the quick brown fox jumps over the lazy dog. "
    start = int(rng.integers(0, len(base)))
    return "".join(base[(start + i) % len(base)] for i in range(length))


def leaf_shakespeare(root: Path, clients: int = 3, n: int = 30, seed: int = 0) -> list[str]:
    """LEAF Shakespeare: 80-character windows and the character after each."""
    rng = np.random.default_rng(seed)
    ids = [f"THE_PLAY_ROLE{i}" for i in range(clients)]
    for split, count in (("train", n), ("test", n // 3)):
        users = {}
        for u in ids:
            xs, ys = [], []
            for _ in range(count):
                t = _text(rng, 81)
                xs.append(t[:80])
                ys.append(t[80])
            users[u] = (xs, ys)
        _leaf_split(root, split, users)
    return ids


def leaf_sent140(root: Path, clients: int = 4, n: int = 20, seed: int = 0) -> list[str]:
    """Sent140: tweets with 'love' are positive (1), with 'hate' negative (0)."""
    rng = np.random.default_rng(seed)
    ids = [f"user{i}" for i in range(clients)]
    fill = ["the", "day", "it", "was", "so", "a", "movie", "today"]
    for split, count in (("train", n), ("test", n // 2)):
        users = {}
        for u in ids:
            xs, ys = [], []
            for j in range(count):
                label = int(rng.integers(0, 2))
                words = list(rng.choice(fill, 5)) + ["love" if label else "hate"]
                rng.shuffle(words)
                xs.append([str(j), "Sat May 16 2009", "NO_QUERY", u, " ".join(words), "training"])
                ys.append(label)
            users[u] = (xs, ys)
        _leaf_split(root, split, users)
    return ids


def _write_h5(path: Path, clients: dict[str, dict]) -> None:
    import h5py

    text = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        g = f.create_group("examples")
        for cid, feats in clients.items():
            cg = g.create_group(cid)
            for name, value in feats.items():
                if isinstance(value, list):
                    cg.create_dataset(name, data=np.array(value, dtype=object), dtype=text)
                else:
                    cg.create_dataset(name, data=value)


def tff_shakespeare(root: Path, clients: int = 3, snippets: int = 6, seed: int = 0) -> list[str]:
    """TFF Shakespeare: `snippets` per speaking role."""
    rng = np.random.default_rng(seed)
    ids = [f"ROLE_{i}" for i in range(clients)]
    for split, count in (("train", snippets), ("test", 2)):
        _write_h5(root / f"shakespeare_{split}.h5",
                  {u: {"snippets": [_text(rng, int(rng.integers(40, 120))) + " café"  # é: OOV
                                    for _ in range(count)]}
                   for u in ids})
    return ids


SO_WORDS = ["how", "to", "the", "python", "java", "list", "class", "error", "in", "a", "loop",
            "string", "map", "thread", "file"]
SO_TAGS = ["python", "java", "c", "go", "rust", "ruby", "swift", "perl"]


def tff_stackoverflow(root: Path, clients: int = 4, posts: int = 12, seed: int = 0) -> list[str]:
    """TFF Stack Overflow: posts whose words name their tag, with the word and tag count files."""
    rng = np.random.default_rng(seed)
    (root / "stackoverflow.word_count").write_text(
        "".join(f"{w} {100 - i}\n" for i, w in enumerate(SO_WORDS)))
    (root / "stackoverflow.tag_count").write_text(json.dumps({t: 10 - i for i, t in enumerate(SO_TAGS)}))
    ids = [f"{i:08d}" for i in range(clients)]
    for split, count in (("train", posts), ("test", posts // 3)):
        data = {}
        for u in ids:
            toks, titles, tags = [], [], []
            for _ in range(count):
                tag = SO_TAGS[int(rng.integers(0, len(SO_TAGS)))]
                words = ["how", "to"] + list(rng.choice(SO_WORDS[5:], 4)) + [tag, "in", tag]
                toks.append(" ".join(words))
                titles.append(f"{tag} error")
                tags.append(tag)
            data[u] = {"tokens": toks, "title": titles, "tags": tags,
                       "score": np.zeros(count, np.int64), "type": ["question"] * count}
        _write_h5(root / f"stackoverflow_{split}.h5", data)
    return ids
