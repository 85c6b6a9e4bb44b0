import json
import math

import ml_dtypes
import numpy as np
import pytest

from zerojax import cli, formats

VALUES = [0.1, 1.0, -2.5, 70000.0, 0.000001, 1e-8, 3.14159, 448.0, 65504.0, 1e30, -0.0, 2.0**-20]


@pytest.mark.parametrize("name", formats.FORMATS)
@pytest.mark.parametrize("value", VALUES)
def test_every_cell_matches_the_ml_dtypes_cast(name, value):
    s = formats.store(value, name)
    with np.errstate(over="ignore"):
        held = np.array(value).astype(formats.dtype(name))  # the reference cast
    word = int(held.view(f"uint{held.dtype.itemsize * 8}"))
    f = ml_dtypes.finfo(held.dtype)
    assert (s.sign + s.exponent + s.mantissa) == format(word, f"0{held.dtype.itemsize * 8}b")
    assert len(s.exponent) == f.nexp and len(s.mantissa) == f.nmant
    ref = float(held.astype(np.float64))
    assert (math.isnan(s.stored) and math.isnan(ref)) or s.stored == ref
    if s.status == "ok" and value != 0:
        assert s.rel_error == abs(ref - value) / abs(value)
        assert s.rel_error <= f.eps / 2 or abs(value) < f.smallest_normal  # round to nearest


def test_bit_fields_decode_to_the_stored_value():
    s = formats.store(0.1, "bfloat16")
    assert s.bits == "0 01111011 1001101"  # DESIGN §4's example
    mantissa = 1 + int(s.mantissa, 2) / 2**7
    assert s.stored == (-1) ** int(s.sign) * mantissa * 2.0 ** (int(s.exponent, 2) - 127)


def test_the_seeds_self_check_facts():
    def add(a, b, name):
        t = formats.dtype(name)
        return float((np.array(a, t) + np.array(b, t)).astype(np.float64))

    assert add(1.0, 0.0001, "float16") == 1.0 and add(1.0, 0.0001, "bfloat16") == 1.0
    assert add(1.0, 0.0001, "float32") != 1.0
    assert formats.store(70000, "float16").status == "overflow" and formats.store(70000, "float16").stored == math.inf
    assert formats.store(70000, "float8_e4m3fn").status == "nan"
    assert formats.store(70000, "bfloat16").status == "ok"
    assert formats.store(1e-8, "float16").status == "underflow" and formats.store(1e-8, "bfloat16").status == "ok"
    assert formats.info("float8_e4m3fn").max == 448 and not formats.info("float8_e4m3fn").has_inf


def test_format_table_is_the_seeds_table():
    t = formats.table()
    expected = {  # bits split, largest finite, gap after 1.0 (the seed's table)
        "float32": ("1 / 8 / 23", 3.4028234663852886e38, 2**-23),
        "bfloat16": ("1 / 8 / 7", 3.3895313892515355e38, 2**-7),
        "float16": ("1 / 5 / 10", 65504, 2**-10),
        "float8_e4m3fn": ("1 / 4 / 3", 448, 2**-3),
        "float8_e5m2": ("1 / 5 / 2", 57344, 2**-2),
    }
    assert {k: (v["bits"], v["max"], v["eps"]) for k, v in t.items()} == expected
    assert t["float16"]["smallest_normal"] == 2**-14 and t["float16"]["smallest_subnormal"] == 2**-24


def test_cli_json_is_the_contract_document(capsys):
    assert cli.main(["formats", "0.1", "70000", "0.000001", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [v["input"] for v in doc["values"]] == ["0.1", "70000", "0.000001"]
    cell = doc["values"][0]["formats"]["bfloat16"]
    assert cell == {"bits": "0 01111011 1001101", "stored": 0.10009765625,
                    "rel_error": pytest.approx(0.0009765625), "status": "ok"}
    assert set(doc["values"][1]["formats"]) == set(formats.FORMATS)
    assert doc["values"][1]["formats"]["float16"] == {"bits": "0 11111 0000000000", "stored": "inf",
                                                      "rel_error": None, "status": "overflow"}
    assert doc["values"][2]["formats"]["float8_e5m2"]["status"] == "underflow"


def test_cli_tables(capsys):
    assert cli.main(["formats", "70000", "--table"]) == 0
    out = capsys.readouterr().out
    assert "overflow" in out and "FP8 E4M3" in out and "57344" in out and "2^-10" in out


@pytest.mark.parametrize("args", [["formats", "abc"], ["formats"], ["formats", "1", "--bogus"]])
def test_cli_bad_values_exit_2(args, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1
