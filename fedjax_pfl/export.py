"""Exported models: a run's final server model and personal models as safetensors files.

    OUT/final/global.safetensors     the server's model, one tensor per parameter leaf
    OUT/final/personal.safetensors   the personal models, each leaf stacked on a leading client
                                     axis [N, ...] (row i: client i's model)
    OUT/final/model.json             what the tensors are: the model (name, options, input shape,
                                     classes, task, the input normalisation), the algorithm, which
                                     file holds what, how a client's model is formed, N, the
                                     library's version

Tensor names are the parameter tree's paths joined by "/" (`jax.tree_util.keystr(path,
simple=True, separator="/")`: "Dense_0/kernel"), the names `models.split.leaf_paths` gives, so a
file opens in any safetensors reader (PyTorch, NumPy, Rust) and `load` puts each tensor back in
its place of the model's tree.

What is "the server model" and what "the personal models" is declared per algorithm family
(`RULES`, one line per algorithm; docs/exports.md lists them), by the model each algorithm's
own `evaluate` scores as "client" (the headline accuracy) and as "global":

  server        the global model is every client's model (FedAvg, FedProx, SCAFFOLD, FedDyn,
                MOON, FedAvg-SAR): global only
  fine_tuned    the global model, which each client fine-tunes on its training data before
                evaluating it (FedAvg-FT, FedProx-FT, Per-FedAvg, FedBABU): global only; the
                fine-tuned models exist only inside the evaluation and are not exported
  personal      a personal model per client kept in the state (Ditto, pFedMe, FedALA, PGFed,
                TDPFed with their global model; pFedSOP, Local, FedAMP, FedDWA, FedFomo without)
  merged        a shared part and a part kept per client (FedPer, LG-FedAvg, FedRep, FedPC):
                the personal file holds each client's whole model (the shared leaves repeated),
                model.json's "shared_tensors" names the leaves the server averages
  mixed         APFL: client i's model α_i·v_i + (1 − α_i)·w, formed as its evaluation forms it
  two_heads     FedRoD: the generic model (global) and each client's personal head (personal,
                the head's leaves only); client i's logits are f(x; w) + f(x; w's body with
                head φ_i), `client_logits`

Under host state placement the personal rows are read from the host store (every client's, its
initial row where no round wrote one). Rows the state keeps in bfloat16 (`--state-dtype
bfloat16`) are written as safetensors BF16 tensors (the `safetensors.numpy` API takes
`ml_dtypes.bfloat16` arrays as they are, tested) and load back as bfloat16; the engine computes
with them in float32 (`core.gather`), and so should a reader. A multi-process run does not
export (its per-client rows are spread over the processes): `check_run` refuses it in one line
before the run starts; resume its last checkpoint in one process with `--export` instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl import core, ops
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

Params = Any

FINAL_DIR = "final"
GLOBAL_FILE = "global.safetensors"
PERSONAL_FILE = "personal.safetensors"
MODEL_FILE = "model.json"
FORMAT_VERSION = 1
HF_PREFIX = "hf:"                  # a pretrained model's name: hf:PATH (its folder)


class ExportError(ValueError):
    """An export that cannot be written or read back; the message names the file."""


class Parts(NamedTuple):
    """What an algorithm's state exports: `global_params` (leaves [...], or None), `personal`
    (leaves [N, ...], or None; None holes where a client keeps part of the model only), and
    `client_model`, the rule by which a client's evaluated model is formed (`CLIENT_MODELS`)."""

    global_params: Params | None
    personal: Params | None
    client_model: str
    shared: Params | None = None     # merged: the server-averaged part (None on the kept leaves)


CLIENT_MODELS = {
    "global": "every client's model is the global model",
    "fine_tuned": "each client fine-tunes the global model on its own training data before "
                  "evaluating it (the algorithm's evaluation rule); the fine-tuned models are "
                  "not exported",
    "personal": "client i's model is row i of the personal tensors",
    "two_heads": "client i's logits are f(x; global) + f(x; global with its head leaves replaced "
                 "by row i of the personal tensors) (FedRoD)",
    "adapter_mixture": "client i's model adds (1 - lambda) times the global adapter's low-rank "
                       "terms and lambda times those of row i of the personal adapters (FedDPA; "
                       "lambda fixed, or per input by its similarity to the client's training "
                       "data: hparams weighting, refs, scale)",
}


# -- what each algorithm family exports -----------------------------------------------------------


def _server(state) -> Parts:
    return Parts(state.params, None, "global")


def _fine_tuned(state) -> Parts:
    return Parts(state.params, None, "fine_tuned")


def _personal(rows: Callable[[Any], Params],
              server: Callable[[Any], Params] | None = None) -> Callable[[Any], Parts]:
    return lambda state: Parts(None if server is None else server(state), rows(state), "personal")


def _merged(shared: Callable[[Any], Params], kept: Callable[[Any], Params]
            ) -> Callable[[Any], Parts]:
    """FedAvg on part of the model, each client keeping the rest: the shared leaves (None on the
    kept) and the kept rows (None on the shared), merged into each client's whole model as the
    algorithm's evaluation merges them (`models.split.merge`)."""

    def parts(state) -> Parts:
        body, rows = shared(state), kept(state)
        if not jax.tree.leaves(rows):      # nothing kept (FedPer --fedper-head none): FedAvg
            return Parts(body, None, "global")
        n = int(jax.tree.leaves(rows)[0].shape[0])
        whole = jax.tree.map(lambda s, r: r if s is None else jnp.broadcast_to(s, (n, *s.shape)),
                             body, rows, is_leaf=lambda x: x is None)
        return Parts(None, whole, "personal", shared=body)

    return parts


def _apfl(state) -> Parts:
    """APFL: client i's model α_i·v_i + (1 − α_i)·w, computed as its `evaluate` computes it
    (`ops.tree_lerp`, the rows in float32 as `core.gather` gives them)."""
    local = jax.tree.map(_compute_dtype, state.local)
    mixed = jax.jit(jax.vmap(ops.tree_lerp, in_axes=(None, 0, 0)))(state.params, local,
                                                                   _compute_dtype(state.alpha))
    return Parts(state.params, mixed, "personal")


def _fedrod(state) -> Parts:
    return Parts(state.params, state.heads, "two_heads")


def _feddpa(state) -> Parts:
    return Parts(state.params, state.local, "adapter_mixture")


def _tdpfed(state) -> Parts:
    from fedjax_pfl.models import cp

    return Parts(cp.reconstruct(state.factors), state.theta, "personal")


RULES: dict[str, Callable[[Any], Parts]] = {
    "fedavg": _server, "fedprox": _server, "scaffold": _server, "feddyn": _server,
    "moon": _server, "fedavg_sar": _server,
    "fedavg_ft": _fine_tuned, "fedprox_ft": _fine_tuned, "perfedavg": _fine_tuned,
    "fedbabu": _fine_tuned,
    "ditto": _personal(lambda s: s.personal, lambda s: s.params),
    "pfedme": _personal(lambda s: s.theta, lambda s: s.params),
    "fedala": _personal(lambda s: s.params, lambda s: s.global_params),
    "pgfed": _personal(lambda s: s.clients.theta, lambda s: s.global_params),
    "pgfed_ce": _personal(lambda s: s.clients.theta, lambda s: s.global_params),
    "pgfedmo": _personal(lambda s: s.clients.theta, lambda s: s.global_params),
    "tdpfed": _tdpfed,
    "pfedsop": _personal(lambda s: s.clients.x),
    "local": _personal(lambda s: s.params), "fedamp": _personal(lambda s: s.params),
    "feddwa": _personal(lambda s: s.params), "fedfomo": _personal(lambda s: s.params),
    "fedper": _merged(lambda s: s.body, lambda s: s.heads),
    "lg_fedavg": _merged(lambda s: s.body, lambda s: s.heads),
    "fedrep": _merged(lambda s: s.body, lambda s: s.heads),
    "fedpc": _merged(lambda s: s.x, lambda s: s.z),
    "apfl": _apfl,
    "fedrod": _fedrod,
    "ffa_lora": _server, "feddpa": _feddpa,
}


def parts(algo: str, state: Any, num_clients: int | None = None) -> Parts:
    """The global and personal models of `algo`'s `state` (a full state pytree, its per-client
    leaves [N, ...]), the personal rows cut to the first `num_clients` (the real clients)."""
    if algo not in RULES:
        raise ExportError(f"{arg('algo')} {algo!r} declares no export (fedjax_pfl.export.RULES)")
    p = RULES[algo](state)
    personal = p.personal
    if personal is not None and num_clients is not None:
        personal = jax.tree.map(lambda x: x[:num_clients], personal)
    return p._replace(personal=personal)


def _compute_dtype(x):
    return x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x


# -- the model's description ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What rebuilds the model the tensors belong to (`models.get`'s arguments), and how its
    inputs are normalised (x · input_scale + input_shift, `FederatedData.inputs`)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    cr: float = 2.0
    conv: str = "auto"
    options: dict = dataclasses.field(default_factory=dict)
    task: dict | None = None
    input_scale: float = 1.0
    input_shift: float = 0.0
    dtype: str | None = None          # a pretrained model's (`model_dtype`); None: float32

    def build(self) -> Model:
        from fedjax_pfl import models
        from fedjax_pfl.models.tasks import Task

        if self.name.startswith(HF_PREFIX):   # a pretrained decoder: its folder rebuilds it
            from fedjax_pfl.models import hf

            path = self.name[len(HF_PREFIX):]
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ValueError(f"the pretrained model's folder {path} (its config.json) is "
                                 "not there: the export holds the weights, the folder the "
                                 "architecture")
            return hf.model_from_hf(path, dtype=self.dtype or "float32")
        task = None
        if self.task is not None:
            fields = dict(self.task)
            fields["metric_excluded"] = tuple(fields.get("metric_excluded", ()))
            task = Task(**fields)
        return models.get(self.name, tuple(self.input_shape), self.num_classes, cr=self.cr,
                          conv=self.conv, task=task, options=dict(self.options))

    def record(self) -> dict:
        out = dataclasses.asdict(self)
        out["input_shape"] = [int(s) for s in self.input_shape]
        return out


def tensor_names(tree: Params) -> list[str]:
    """The '/'-joined path of every leaf of `tree` in `jax.tree.leaves` order (None holes
    skipped): the tensors' names in the files."""
    return split_lib.leaf_paths(tree)


# -- writing --------------------------------------------------------------------------------------


def save(directory: str, algo: str, state: Any, spec: ModelSpec, *,
         num_clients: int | None = None, hparams: dict | None = None) -> dict:
    """Writes `algo`'s `state` (a full state pytree, per-client leaves [N, ...]; `full_state`
    makes one of a program's state) to `directory`: global.safetensors, personal.safetensors
    (each where the algorithm has that model) and model.json, whose record it returns. Usable on
    any state, e.g. one restored from a checkpoint. `num_clients`: the real clients (the rows
    beyond are padding); `hparams`: recorded in model.json."""
    from fedjax_pfl import __version__

    p = parts(algo, state, num_clients)
    os.makedirs(directory, exist_ok=True)
    record: dict[str, Any] = {
        "format": "fedjax_pfl.export", "format_version": FORMAT_VERSION,
        "library_version": __version__, "algorithm": algo,
        "model": spec.record(), "client_model": p.client_model,
        "client_model_rule": CLIENT_MODELS[p.client_model],
        "num_clients": None, "global_tensors": [], "personal_tensors": [], "dtypes": {},
    }
    if hparams is not None:
        record["hparams"] = _jsonable(hparams)
    for name, tree, key in ((GLOBAL_FILE, p.global_params, "global_tensors"),
                            (PERSONAL_FILE, p.personal, "personal_tensors")):
        path = os.path.join(directory, name)
        if tree is None:
            if os.path.exists(path):          # (a stale file of an earlier export)
                os.remove(path)
            continue
        tensors = _host_tensors(tree)
        _write_safetensors(path, tensors, {"algorithm": algo, "file": name})
        record[key] = list(tensors)
        record["dtypes"][name] = sorted({str(a.dtype) for a in tensors.values()})
        if key == "personal_tensors":
            record["num_clients"] = int(next(iter(tensors.values())).shape[0])
    if p.shared is not None:
        record["shared_tensors"] = tensor_names(p.shared)
    _write_text(os.path.join(directory, MODEL_FILE), json.dumps(record, indent=1) + "\n")
    return record


def _host_tensors(tree: Params) -> dict[str, np.ndarray]:
    names = tensor_names(tree)
    leaves = jax.device_get(jax.tree.leaves(tree))
    if len(set(names)) != len(names):
        raise ExportError(f"two leaves share a name among {names}")
    return {n: np.ascontiguousarray(np.asarray(a)) for n, a in zip(names, leaves)}


def _write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict) -> None:
    from safetensors.numpy import save_file

    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)              # a reader never sees half a file


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item")
                                 else str(v)))


# -- a run's export (the runner's) ----------------------------------------------------------------


def check_run(export: bool, out: str | None) -> None:
    """OptionError in one line where `export` cannot be honoured: no output directory, or a
    multi-process run (module docstring). Called by `RunConfig.validate`."""
    if not export:
        return
    if not out:
        raise OptionError(f"{arg('export')} writes OUT/{FINAL_DIR}/: it needs {arg('out')} DIR")
    if jax.process_count() > 1:
        raise OptionError(f"{arg('export')} does not apply to a multi-process run (its "
                          f"per-client rows are spread over the processes): resume its last "
                          f"checkpoint in one process with {arg('export')}")


def full_state(program: core.Program, state: Any) -> Any:
    """The state pytree of a program's state: under host state placement (`core.StoredState`)
    its device leaves joined with every client's rows read from the host store."""
    if not isinstance(state, core.StoredState):
        return state
    split = program.placements.state.host
    rows = state.store.gather(np.arange(program.num_clients))
    return split.treedef.unflatten(split.join(jax.device_get(state.device), rows))


def model_spec(cfg: Any, model_name: str, data: Any) -> ModelSpec:
    """The `ModelSpec` of a run: its RunConfig, model name and federated data."""
    task = None if data.task is None else dataclasses.asdict(data.task)
    return ModelSpec(model_name, tuple(int(s) for s in data.input_shape), int(data.num_classes),
                     cr=float(cfg.model_cr), conv=str(cfg.model_conv),
                     options=dict(cfg.model_options), task=task,
                     input_scale=float(data.input_scale), input_shift=float(data.input_shift),
                     dtype=(str(cfg.model_dtype or "float32")
                            if model_name.startswith(HF_PREFIX) else None))


def export_run(prep: Any, state: Any, out: str) -> dict:
    """A finished run's export to OUT/final/ (`runner.run` with `RunConfig.export`): its final
    state (`full_state`), the real clients' rows. With adapters (`peft` lora): `export_peft_run`."""
    cfg = prep.cfg
    if getattr(prep, "lora", None) is not None:
        return export_peft_run(prep, state, out)
    full = full_state(prep.program, state)
    directory = os.path.join(out, FINAL_DIR)
    record = save(directory, cfg.algo, full, model_spec(cfg, prep.model_name, prep.data),
                  num_clients=prep.data.num_real_clients, hparams=prep.hparams)
    name = prep.model_name
    global_params = parts(cfg.algo, full, prep.data.num_real_clients).global_params
    if name.startswith(HF_PREFIX) and global_params is not None:
        # (a pretrained model trained whole: its global model in the Hugging Face layout too)
        record["hf"] = save_hf(os.path.join(directory, "hf"), global_params,
                               name[len(HF_PREFIX):])
    return record


# -- reading --------------------------------------------------------------------------------------


def load(directory: str) -> tuple[Model, Params | None, Params | None]:
    """(model, global_params or None, personal_params or None) of an export: the model rebuilt
    from model.json, each file's tensors put back in the model's parameter tree (personal leaves
    [N, ...]; a part-model export, FedRoD's heads, has None on the leaves it does not hold).
    A missing or unreadable file, or a tensor that does not fit the model: ExportError naming
    the file."""
    record = read_record(directory)
    try:
        spec = ModelSpec(**{**record["model"], "input_shape": tuple(record["model"]["input_shape"])})
        model = spec.build()
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{os.path.join(directory, MODEL_FILE)}: its model cannot be rebuilt "
                          f"({e})") from None
    template = jax.eval_shape(model.init, jax.random.key(0))
    out: list[Params | None] = []
    for name, key, stacked in ((GLOBAL_FILE, "global_tensors", False),
                               (PERSONAL_FILE, "personal_tensors", True)):
        names = record.get(key) or []
        if not names:
            out.append(None)
            continue
        path = os.path.join(directory, name)
        out.append(_into_tree(path, _read_safetensors(path), template, names,
                              record.get("num_clients") if stacked else None))
    return model, out[0], out[1]


def read_record(directory: str) -> dict:
    """model.json of an export (ExportError naming it when missing or not an export's)."""
    path = os.path.join(directory, MODEL_FILE)
    if not os.path.isfile(path):
        raise ExportError(f"{path}: missing (an export writes {MODEL_FILE} beside its "
                          f"safetensors files)")
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(record, dict) or record.get("format") != "fedjax_pfl.export":
        raise ExportError(f"{path}: not a fedjax_pfl export's {MODEL_FILE}")
    return record


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    if not os.path.isfile(path):
        raise ExportError(f"{path}: missing (model.json lists its tensors)")
    try:
        return load_file(path)
    except Exception as e:       # (safetensors raises its own SafetensorError, or OSError)
        raise ExportError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _into_tree(path: str, tensors: dict[str, np.ndarray], template: Params, names: list[str],
               rows: int | None) -> Params:
    """The template's tree with each named tensor in its leaf (None on the leaves not in
    `names`), each checked against the leaf's shape (with the leading `rows` axis)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    wanted = set(names)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ExportError(f"{path}: missing tensor(s) {missing[:4]}")
    unknown = sorted(wanted - set(tensor_names(template)))
    if unknown:
        raise ExportError(f"{path}: tensor(s) {unknown[:4]} are no parameter of the model")
    leaves: list[Any] = []
    for p, leaf in flat:
        name = jax.tree_util.keystr(p, simple=True, separator="/")
        if name not in wanted:
            leaves.append(None)
            continue
        a = tensors[name]
        shape = tuple(leaf.shape) if rows is None else (int(rows), *leaf.shape)
        if tuple(a.shape) != shape:
            raise ExportError(f"{path}: tensor {name} has shape {tuple(a.shape)}, the model's "
                              f"is {shape}")
        leaves.append(a)
    return treedef.unflatten(leaves)


def client_logits(model: Model, global_params: Params | None, personal: Params | None,
                  client: int, x: jax.Array, rule: str = "personal") -> jax.Array:
    """Client `client`'s outputs on inputs `x` by the export's `rule` (model.json's
    "client_model"): the global model's, row `client` of the personal models', or FedRoD's two
    heads; in float32 (bfloat16 rows upcast, as the engine computes)."""
    if rule in ("global", "fine_tuned"):
        return model.apply(_f32(global_params), x)
    row = jax.tree.map(lambda a: a[client], personal)
    if rule == "personal":
        return model.apply(_f32(row), x)
    if rule == "two_heads":
        g = _f32(global_params)
        head = jax.tree.map(lambda w, r: w if r is None else r, g, _f32(row),
                            is_leaf=lambda v: v is None)
        return model.apply(g, x) + model.apply(head, x)
    raise ExportError(f"{arg('rule')} must be one of {list(CLIENT_MODELS)}, got {rule!r}")


def _f32(tree: Params) -> Params:
    return jax.tree.map(lambda a: jnp.asarray(a).astype(jnp.float32)
                        if jnp.asarray(a).dtype == jnp.bfloat16 else jnp.asarray(a), tree)


# -- adapters in PEFT's format --------------------------------------------------------------------

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def peft_module_name(path: str) -> str:
    """Our models' name mapping: a dense module's path ("Block_0/qkv") as a PyTorch module name
    ("Block_0.qkv"), "/" → "." (a Hugging Face model's loader gives its own, `names=`)."""
    return path.replace("/", ".")


def save_peft(directory: str, adapters: Params, config: Any, *,
              names: Callable[[str], str] = peft_module_name,
              task_type: str = "CAUSAL_LM", base_model: str | None = None) -> dict:
    """One adapter (`models.lora`'s tree, leaves [r, d_in] and [d_out, r]) in PEFT's format in
    `directory`: adapter_model.safetensors, tensors `base_model.model.<module>.lora_A.weight`
    [r, d_in] and `….lora_B.weight` [d_out, r] (PEFT's names and shapes: torch's nn.Linear
    weight is [out, in]), and adapter_config.json (peft_type LORA, r, lora_alpha,
    target_modules, lora_dropout, bias "none", task_type). `names` maps a module path to its
    PyTorch module name. Returns the config written."""
    from fedjax_pfl.models import lora

    os.makedirs(directory, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path in config.targets:
        a, b = lora.adapter_of(adapters, path)
        module = PEFT_PREFIX + names(path)
        tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(a)))
        tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(b)))
    _write_safetensors(os.path.join(directory, PEFT_WEIGHTS), tensors, {"format": "pt"})
    record = {"peft_type": "LORA", "r": int(config.rank), "lora_alpha": float(config.alpha),
              "target_modules": sorted({names(p).rsplit(".", 1)[-1] for p in config.targets}),
              "lora_dropout": float(config.dropout), "bias": "none", "task_type": task_type,
              "base_model_name_or_path": base_model, "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "use_rslora": False}
    _write_text(os.path.join(directory, PEFT_CONFIG), json.dumps(record, indent=1) + "\n")
    return record


def load_peft(directory: str, config: Any, *,
              names: Callable[[str], str] = peft_module_name) -> Params:
    """The adapter tree `save_peft` wrote (the inverse: the same arrays in `models.lora`'s
    tree). A tensor missing from the file is an ExportError naming it."""
    from safetensors.numpy import load_file

    from fedjax_pfl.models.lora import LORA_A, LORA_B

    path = os.path.join(directory, PEFT_WEIGHTS)
    if not os.path.exists(path):
        raise ExportError(f"{path}: no such file (a PEFT adapter folder holds {PEFT_WEIGHTS})")
    tensors = load_file(path)
    out: dict = {}
    for target in config.targets:
        node = out
        for part in target.split("/"):
            node = node.setdefault(part, {})
        for key, leaf in ((LORA_A, "lora_A"), (LORA_B, "lora_B")):
            name = f"{PEFT_PREFIX}{names(target)}.{leaf}.weight"
            if name not in tensors:
                raise ExportError(f"{path} has no tensor {name}")
            node[key] = tensors[name]
    return out


def save_peft_run(directory: str, global_adapters: Params | None, personal: Params | None,
                  config: Any, **kwargs) -> dict:
    """A run's adapters in PEFT's format: the global adapter in `directory`/global/ and each
    client's personal adapter (row i of `personal`, leaves [N, ...]) in `directory`/clients/i/,
    one folder each, as PEFT loads one adapter per folder. Returns {"global": …, "clients": N}."""
    out: dict[str, Any] = {}
    if global_adapters is not None:
        out["global"] = save_peft(os.path.join(directory, "global"), global_adapters, config,
                                  **kwargs)
    if personal is not None:
        n = int(jax.tree.leaves(personal)[0].shape[0])
        for i in range(n):
            row = jax.tree.map(lambda x, i=i: x[i], personal)
            save_peft(os.path.join(directory, "clients", str(i)), row, config, **kwargs)
        out["clients"] = n
    return out


def save_merged(directory: str, base: Params, adapters: Params, config: Any, *,
                names: Callable[[str], str] | None = None) -> list[str]:
    """The merged weights W + (α/r)(BA)ᵀ of every targeted kernel with the rest of the base, in
    `directory`/model.safetensors, one tensor per leaf named by its path (or `names(path)`:
    a Hugging Face model's loader maps them to its keys). Returns the tensor names."""
    from fedjax_pfl.models import lora

    merged = lora.merged(base, adapters, config)
    tensors = _host_tensors(merged)
    if names is not None:
        tensors = {names(k): v for k, v in tensors.items()}
    os.makedirs(directory, exist_ok=True)
    _write_safetensors(os.path.join(directory, "model.safetensors"), tensors, {"format": "pt"})
    return list(tensors)


def export_peft_run(prep: Any, state: Any, out: str) -> dict:
    """A LoRA run's export to OUT/final/: the final global adapter in global/ and each real
    client's personal adapter in clients/i/ (`save_peft_run`, PEFT's format; a pretrained
    model's modules by their Hugging Face names, `models.hf.names.hf_name`, so the tensors are
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), and the base merged with
    the global adapter in merged/: for `model` hf:PATH in the Hugging Face layout
    (model.safetensors with HF's names and [out, in] Linear weights, PATH's config.json and
    tokenizer files copied), which `models.hf.load` and `transformers` read; for a zoo model
    `save_merged`'s tensors by parameter path. Returns {"global", "clients", "merged"}."""
    cfg, config = prep.cfg, prep.lora
    p = parts(cfg.algo, full_state(prep.program, state), prep.data.num_real_clients)
    directory = os.path.join(out, FINAL_DIR)
    frozen = getattr(prep, "frozen", None)
    base = None if frozen is None else frozen.value
    name = prep.model_name
    hf_path = name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else None
    kwargs: dict[str, Any] = {"base_model": hf_path or name}
    if hf_path is not None:
        from fedjax_pfl.models.hf import names as hf_names

        kwargs["names"] = hf_names.hf_name
    adapters = p.global_params if p.global_params is not None else p.shared
    record = save_peft_run(directory, adapters, p.personal, config, **kwargs)
    if base is not None and adapters is not None:
        merged_dir = os.path.join(directory, "merged")
        if hf_path is not None:
            record["merged"] = save_merged_hf(merged_dir, base, adapters, config, hf_path)
        else:
            record["merged"] = save_merged(merged_dir, base, adapters, config)
    return record


def save_merged_hf(directory: str, base: Params, adapters: Params, config: Any,
                   source: str) -> list[str]:
    """The merged weights W + (α/r)(BA)ᵀ of a pretrained model (`models.lora.merged`) in the
    Hugging Face layout of its folder `source` (`save_hf`). Returns the tensor names."""
    from fedjax_pfl.models import lora

    return save_hf(directory, lora.merged(base, adapters, config), source)


def save_hf(directory: str, params: Params, source: str) -> list[str]:
    """A pretrained model's parameters `params` in the Hugging Face layout of its folder
    `source`: `directory`/model.safetensors with HF's tensor names and layouts
    (`names.hf_name`, `names.to_hf`: Llama's Linear weights [out, in]), and `source`'s
    config.json and tokenizer files copied beside it, so `models.hf.load` and `transformers`
    read it. Returns the tensor names."""
    import shutil

    from fedjax_pfl.models.hf import names as hf_names
    from fedjax_pfl.models.hf.config import read_config

    model_type = "gpt2" if type(read_config(source)).__name__ == "GPT2Config" else "llama"
    tensors = {hf_names.hf_name(path): np.ascontiguousarray(hf_names.to_hf(path, arr, model_type))
               for path, arr in _host_tensors(params).items()}
    os.makedirs(directory, exist_ok=True)
    _write_safetensors(os.path.join(directory, "model.safetensors"), tensors, {"format": "pt"})
    for file in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(source, file)):
            shutil.copyfile(os.path.join(source, file), os.path.join(directory, file))
    return list(tensors)
