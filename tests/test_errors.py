"""fedjax_pfl.errors: one message, said with the library's argument names or a front end's."""

import pytest

from fedjax_pfl.errors import OptionError, arg


def test_an_option_error_names_arguments_plainly_and_renders_them_per_front_end():
    e = OptionError(f"{arg('eval_every')} 4 must be a multiple of {arg('rounds_per_call')} 3; "
                    f"{arg('alpha', 'hparams')} and {arg('alpha', 'partition')} differ")
    assert str(e) == ("eval_every 4 must be a multiple of rounds_per_call 3; alpha and alpha "
                      "differ")
    flags = {("eval_every", ""): "--eval-every", ("rounds_per_call", ""): "--rounds-per-call",
             ("alpha", "hparams"): "--feddyn-alpha", ("alpha", "partition"): "--alpha"}
    assert e.render(lambda name, space: flags.get((name, space))) == (
        "--eval-every 4 must be a multiple of --rounds-per-call 3; --feddyn-alpha and --alpha "
        "differ")
    assert e.render(lambda name, space: None) == str(e)          # unknown names stay plain
    assert e.arguments[0] == ("eval_every", "")
    assert isinstance(e, ValueError)
    with pytest.raises(ValueError, match="^eval_every 4 must"):
        raise e


def test_marked_errors_of_other_types_and_quoting_one_message_in_another():
    """An exception that is no ValueError (a FileNotFoundError) marks its arguments the same way;
    `marked` keeps the marks when one message quotes another, `spelled` is what a front end
    prints for any exception."""
    from fedjax_pfl.errors import MarkedError, marked, spelled

    class Missing(MarkedError, FileNotFoundError):
        pass

    flags = {("data_dir", "data"): "--data-dir", ("grid", ""): "--grid",
             ("lr", "hparams"): "--lr"}
    spell = lambda name, space: flags.get((name, space))
    e = Missing(f"{arg('data_dir', 'data')} /x is not a directory")
    assert isinstance(e, FileNotFoundError) and str(e) == "data_dir /x is not a directory"
    assert spelled(e, spell) == "--data-dir /x is not a directory"
    assert e.arguments == [("data_dir", "data")]
    inner = OptionError(f"{arg('lr', 'hparams')} must be > 0, got -1.0")
    outer = OptionError(f"{arg('grid')} lr=-1: fedavg on digits: {marked(inner)}")
    assert spelled(outer, spell) == "--grid lr=-1: fedavg on digits: --lr must be > 0, got -1.0"
    assert str(outer) == "grid lr=-1: fedavg on digits: lr must be > 0, got -1.0"
    plain = ValueError("--lr must be > 0")                  # not converted yet: as it is
    assert marked(plain) == spelled(plain, spell) == "--lr must be > 0"
