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
