"""The quantization recipe: defaults, validation, the group-size check."""

import pytest

from fedcompress.quant import QuantConfig


def test_defaults_are_llm_compressors_w4a16():
    config = QuantConfig()
    assert (config.bits, config.group_size, config.symmetric, config.dampening,
            config.block_size, config.method) == (4, 128, True, 0.01, 128, "gptq")
    assert config.needs_hessian and not QuantConfig(method="rtn").needs_hessian
    assert QuantConfig(scheme="w8a16").bits == 8


@pytest.mark.parametrize("field, value, match", [
    ("scheme", "w3a16", "quantization scheme 'w3a16'"),
    ("method", "awq", "quantization method 'awq'"),
    ("group_size", -1, "group size -1"),
    ("group_size", True, "group size True"),
    ("actorder", "dynamic", "activation ordering 'dynamic'"),
    ("dampening", 0.0, "dampening 0.0"),
    ("block_size", 0, "block size 0"),
    ("symmetric", "yes", "symmetric='yes'"),
    ("observer", "mse", "scale observer 'mse'"),
    ("scale_dtype", "int8", "scale dtype 'int8'"),
])
def test_bad_settings_are_refused_by_name(field, value, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**{field: value})


def test_a_group_size_that_does_not_divide_a_layer_names_the_ones_that_do():
    QuantConfig(group_size=64).check_width("layer 0 mlp.down_proj", 1536)
    QuantConfig(group_size=0).check_width("layer 0 self_attn.q_proj", 576)
    with pytest.raises(ValueError, match=r"128 does not divide the 576 input features of "
                                         r"layer 0 self_attn.q_proj.*\(here: 64, 32, 16\)"):
        QuantConfig().check_width("layer 0 self_attn.q_proj", 576)


def test_round_trip_and_unknown_keys():
    config = QuantConfig(scheme="w8a16", group_size=0, symmetric=False, actorder="none")
    assert QuantConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown quantization settings \\['bits'\\]"):
        QuantConfig.from_dict({"bits": 4})
