"""The algorithm registry's contract with every algorithm module (algorithms/registry.py): factories
take the common settings as one `EngineConfig` and their own hyperparameters by name,
`algorithms.get` splits the resolved hyperparameters between the two, every algorithm declares
its test configuration, and no algorithm module imports a sibling. Registered algorithms are
found, not listed: a new module is checked when it registers."""

import ast
import dataclasses
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import _global_model, _split_fedavg, engine, interface, registry
from fedjax_pfl.errors import OptionError

ALGORITHMS_DIR = pathlib.Path(registry.__file__).parent
# The package's modules that are not algorithms: what algorithms are assembled from.
INFRASTRUCTURE = {"interface", "registry", "engine"}


def test_engine_config_is_the_common_hyperparameters_with_their_defaults():
    # Two declarations of the same settings (the dataclass for code, COMMON_HPARAMS for the
    # command line and validation): same names, same order, same defaults; besides them only
    # the run's own settings (RUN_SETTINGS: the held-out clients, no hyperparameter), last.
    fields = dataclasses.fields(engine.EngineConfig)
    assert [f.name for f in fields[-len(engine.RUN_SETTINGS):]] == list(engine.RUN_SETTINGS)
    fields = fields[:-len(engine.RUN_SETTINGS)]
    assert [f.name for f in fields] == [hp.name for hp in registry.COMMON_HPARAMS]
    assert [f.default for f in fields] == [hp.default for hp in registry.COMMON_HPARAMS]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.EngineConfig().lr = 0.1


@pytest.mark.parametrize("name", algorithms.names())
def test_every_factory_takes_the_config_and_its_own_hyperparameters_by_name(name):
    spec = algorithms.spec(name)
    params = list(inspect.signature(spec.factory).parameters.values())
    assert [p.name for p in params[:2]] == ["model", "config"], name
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:2]), name
    own = params[2:]
    assert all(p.kind is p.KEYWORD_ONLY for p in own), f"{name}: no *args/**kwargs, own by name"
    # Each own hyperparameter is a keyword; any other keyword has a default (fedavg's
    # ft_epochs=None: FedAvg-FT's factory shares it).
    declared = {hp.name for hp in spec.hparams}
    assert declared <= {p.name for p in own}, name
    assert all(p.default is not p.empty for p in own if p.name not in declared), name


def test_get_gives_the_factory_the_resolved_common_settings_and_only_its_own_keywords(monkeypatch):
    calls = []

    def probe(model, config, *, mu, ft_epochs):
        calls.append((config, {"mu": mu, "ft_epochs": ft_epochs}))
        return interface.Algorithm("probe", None, None, None, {})

    spec = dataclasses.replace(algorithms.spec("fedprox_ft"), factory=probe)
    monkeypatch.setitem(registry._REGISTRY, "fedprox_ft", spec)
    algo = algorithms.get("fedprox_ft", model=linear_model(), lr=0.2, ft_epochs=3,
                          batch_size=7, local_steps=4)
    [(config, own)] = calls
    # The given values and the defaults (participation 0.25, μ 0.01, ...), each on its side.
    assert config == engine.EngineConfig(participation=0.25, local_epochs=1, local_steps=4,
                                       batch_size=7, lr=0.2, momentum=0.0,
                                       momentum_buffer="reset", drop_last=False,
                                       backend="chunked", chunk_size=0, eval_batch_size=0)
    assert own == {"mu": 0.01, "ft_epochs": 3}
    assert algo.name == "fedprox_ft" and algo.hparams["lr"] == 0.2 and algo.hparams["mu"] == 0.01


def test_build_passes_traced_hyperparameters_through():
    # A sweep calls the factory inside the trace with lr a tracer (fedjax_pfl.sweep): the
    # configuration must hold it as given. One FedAvg round on one client with a single batch of
    # all its n samples is θ − lr·∇L(θ), so the traced lr must scale the update linearly.
    data = make_data([6])
    spec = algorithms.spec("fedavg")
    hp = spec.resolve({"participation": 1.0, "batch_size": 6, "backend": "vmap"})
    model = linear_model()

    def one_round(lr):
        algo = spec.build(model, {**hp, "lr": lr})
        state = algo.init(jax.random.key(0), data)
        return jax.tree.map(lambda a, b: a - b, algo.round_fn(state, data, jax.random.key(1))[0].params,
                            state.params)

    step_1, step_3 = jax.jit(one_round)(jnp.float32(0.1)), jax.jit(one_round)(jnp.float32(0.3))
    for a, b in zip(jax.tree.leaves(step_1), jax.tree.leaves(step_3)):
        assert np.abs(np.asarray(a)).max() > 0
        np.testing.assert_allclose(3 * np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", algorithms.names())
def test_every_algorithm_declares_a_valid_test_configuration(name):
    spec = algorithms.spec(name)
    assert spec.test_hparams is not None, (
        f"{name}: declare AlgorithmSpec.test_hparams (the cross-cutting tests run it)")
    # Valid names and values, and the factory builds on the tests' linear model.
    spec.resolve(spec.test_hparams)
    algorithms.get(name, model=linear_model(), **spec.test_hparams)


def _imported_modules(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_algorithm_module_imports_a_sibling():
    # Shared pieces live in the engine or a private helper module (_prox.py, _global_model.py,
    # _split_fedavg.py), never in another algorithm's module.
    algorithm_modules = {f"fedjax_pfl.algorithms.{p.stem}" for p in ALGORITHMS_DIR.glob("*.py")
                         if p.stem not in INFRASTRUCTURE and not p.stem.startswith("_")}
    assert "fedjax_pfl.algorithms.fedavg" in algorithm_modules
    for module in sorted(algorithm_modules):
        path = ALGORITHMS_DIR / f"{module.rsplit('.', 1)[1]}.py"
        siblings = (_imported_modules(path) & algorithm_modules) - {module}
        assert not siblings, f"{path.name} imports {sorted(siblings)}"


def test_old_state_names_are_the_shared_types():
    from fedjax_pfl.algorithms import fedavg, fedper, fedprox, perfedavg

    assert fedavg.State is fedprox.State is perfedavg.State is _global_model.GlobalModelState
    assert fedper.State is _split_fedavg.SplitModelState


def test_init_refuses_a_model_whose_outputs_are_not_the_data_classes():
    """A classifier built for 4 classes on data of 3 trains without an error and scores output
    positions against labels of another range: `init` refuses it, naming both widths, as it
    refuses data that is not a FederatedData."""
    from helpers import make_data

    from fedjax_pfl import models

    data = make_data([5, 6], num_classes=3)
    wrong = models.get("mlp", data.input_shape, 4)
    algo = algorithms.get("fedavg", model=wrong)
    with pytest.raises(ValueError, match=r"gives 4 outputs per example but the data .* has 3 "
                                         r"classes: build the model for num_classes=3"):
        algo.init(jax.random.key(0), data)
    with pytest.raises(TypeError, match=r"data must be a fedjax_pfl.data.FederatedData, got dict"):
        algo.init(jax.random.key(0), {"x": data.x})
    right = algorithms.get("fedavg", model=models.get("mlp", data.input_shape, 3))
    state = right.init(jax.random.key(0), data)
    assert int(state.round) == 0               # (the right width is not refused)


# -- the notebook API's wrong inputs: one line naming the mismatch, checked once per structure --


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and isinstance(excinfo.value, OptionError)
    return msg


def test_round_fn_refuses_the_state_of_another_algorithm_naming_it():
    data = make_data([6] * 4)
    fedavg = algorithms.get("fedavg", model=linear_model(), lr=0.1)
    ditto = algorithms.get("ditto", model=linear_model(), lr=0.1)
    state = fedavg.init(jax.random.key(0), data)
    ditto.init(jax.random.key(0), data)
    for round_fn in (ditto.round_fn, jax.jit(ditto.round_fn)):
        with pytest.raises(OptionError) as e:
            round_fn(state, data, jax.random.key(1))
        # (every algorithm whose init made this structure in this process is named: FedProx's
        # state is FedAvg's, and other tests may have made it)
        said = _one_line(e)
        makers = said.removeprefix("state: made by ").split("'s init")[0].split(" or ")
        assert "fedavg" in makers and "ditto" not in makers, said
        assert said.endswith("'s init, not ditto's: ditto.round_fn takes the state ditto's init "
                             "makes"), said
    with pytest.raises(OptionError, match=r"^state: made by (\w+ or )*fedavg( or \w+)*'s init, not "
                                          r"ditto's: ditto.evaluate takes"):
        ditto.evaluate(state, data)
    # A structure no init made: its class and the structure expected.
    fresh = algorithms.get("ditto", model=linear_model(), lr=0.1)
    with pytest.raises(OptionError) as e:
        fresh.round_fn({"w": jnp.zeros((5, 3))}, data, jax.random.key(1))
    assert _one_line(e).startswith("state: a dict of another structure than the state ditto's "
                                   "init makes (a State of ")
    with pytest.raises(OptionError) as e:
        ditto.round_fn(state, {"x": data.x}, jax.random.key(1))
    assert _one_line(e) == ("round_fn(state, data, ...): data must be a "
                            "fedjax_pfl.data.FederatedData, got dict")


@pytest.mark.slow
def test_round_fn_and_evaluate_refuse_a_state_made_for_another_client_count():
    ten, twelve = make_data([6] * 10), make_data([6] * 12)
    ditto = algorithms.get("ditto", model=linear_model(), lr=0.1)
    state = ditto.init(jax.random.key(0), ten)
    calls = {"round_fn": lambda s, d: ditto.round_fn(s, d, jax.random.key(1)),
             "jitted round_fn": lambda s, d: jax.jit(ditto.round_fn)(s, d, jax.random.key(1)),
             "evaluate": ditto.evaluate}
    for name, call in calls.items():
        with pytest.raises(OptionError) as e:
            call(state, twelve)
        assert _one_line(e) == "state: made for 10 clients, this data has 12", name
    # A state this algorithm object never made (a checkpoint's): init run abstractly decides.
    other = algorithms.get("ditto", model=linear_model(), lr=0.1)
    with pytest.raises(OptionError, match=r"^state: made for 10 clients, this data has 12$"):
        other.round_fn(state, twelve, jax.random.key(1))
    state, _ = other.round_fn(state, ten, jax.random.key(1))           # the right data is taken
    assert int(state.round) == 1
    # FedAvg's state holds no per-client rows: made for 10 clients, it is right for 12 too.
    fedavg = algorithms.get("fedavg", model=linear_model(), lr=0.1)
    g, _ = fedavg.round_fn(fedavg.init(jax.random.key(0), ten), twelve, jax.random.key(1))
    assert int(g.round) == 1


@pytest.mark.parametrize("labels, message", [
    (lambda y: None, "data.y is None: the dataset has no labels"),
    (lambda y: y[:, None], r"data.y has shape \[48, 1\]; classify labels are \[n\] with n = 48, "
                           r"the rows of data.x"),
    (lambda y: y[:40], r"data.y has shape \[40\]; classify labels are \[n\] with n = 48"),
    (lambda y: y.astype(jnp.float32), r"data.y has dtype float32; labels are integer class ids"),
])
def test_init_and_round_refuse_data_without_labels_or_labels_of_another_shape(labels, message):
    data = make_data([9, 9, 9, 9], test_sizes=[3, 3, 3, 3])          # n = 48 rows
    algo = algorithms.get("fedavg", model=linear_model(), lr=0.1)
    state = algo.init(jax.random.key(0), data)
    wrong = dataclasses.replace(data, y=labels(data.y))
    with pytest.raises(OptionError, match="^init: " + message) as e:
        algo.init(jax.random.key(0), wrong)
    _one_line(e)
    with pytest.raises(OptionError, match="^round_fn: " + message) as e:
        jax.jit(algo.round_fn)(state, wrong, jax.random.key(1))
    _one_line(e)


def test_sequence_labels_are_n_by_t():
    """A per-token task's labels are [n, T]: one label per sample is refused, [n, T] taken."""
    from fedjax_pfl.algorithms.registry import check_labels
    from fedjax_pfl.models.tasks import Task

    x = jnp.zeros((6, 4), jnp.int32)
    task = Task("sequence", num_classes=7, inputs="tokens", vocab_size=7)
    data = make_data([2, 2], test_sizes=[1, 1])
    ok = dataclasses.replace(data, x=x, y=jnp.zeros((6, 4), jnp.int32), task=task)
    check_labels(ok, "init")
    with pytest.raises(OptionError, match=r"^init: data.y has shape \[6\]; sequence labels are "
                                          r"\[n, T\] with n = 6"):
        check_labels(dataclasses.replace(ok, y=jnp.zeros((6,), jnp.int32)), "init")


@pytest.mark.slow
def test_input_checks_run_once_per_structure(monkeypatch):
    """The checks read structure and shapes: under jit they run when the round is traced, and
    eagerly a signature accepted once is not checked again."""
    seen = []
    real = registry.InputChecks.state
    monkeypatch.setattr(registry.InputChecks, "state",
                        lambda self, *a: (seen.append(a[-1]), real(self, *a))[1])
    data = make_data([6] * 4)
    algo = algorithms.get("ditto", model=linear_model(), lr=0.1, backend="loop")
    state = algo.init(jax.random.key(0), data)
    round_fn = jax.jit(algorithms.get("ditto", model=linear_model(), lr=0.1).round_fn)
    jitted = state
    for r in range(3):
        jitted, _ = round_fn(jitted, data, jax.random.key(r))
    assert seen == ["round_fn"]                                        # traced once
    for r in range(3):
        state, _ = algo.round_fn(state, data, jax.random.key(r))       # loop backend: eager
    assert seen == ["round_fn", "round_fn"]
    with pytest.raises(OptionError, match="made for 4 clients"):
        algo.round_fn(state, make_data([6] * 5), jax.random.key(0))     # a new structure: checked
    assert seen == ["round_fn"] * 3
