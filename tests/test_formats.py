import json
import math

import numpy as np
import pytest

from zerojax import cli, formats

VALUES = [0.1, 1.0, -2.5, 70000.0, 0.000001, 1e-8, 3.14159, 448.0, 65504.0, 1e30, -0.0, 2.0**-20]


# The seed's table, written out: exponent bits, mantissa bits, whether the top exponent is
# inf/NaN (IEEE) or, in E4M3's "fn" variant, ordinary numbers except S.1111.111 = NaN.
LAYOUT = {"float32": (8, 23, True), "bfloat16": (8, 7, True), "float16": (5, 10, True),
          "float8_e4m3fn": (4, 3, False), "float8_e5m2": (5, 2, True)}


def decode(sign: str, exponent: str, mantissa: str, name: str) -> float:
    """The value of a bit pattern, by the test's own arithmetic (no numpy, no ml_dtypes)."""
    e_bits, m_bits, ieee = LAYOUT[name]
    e, m, bias, top = int(exponent, 2), int(mantissa, 2), 2 ** (e_bits - 1) - 1, 2**e_bits - 1
    s = -1.0 if sign == "1" else 1.0
    if e == top and (ieee or m == 2**m_bits - 1):
        return s * math.inf if ieee and m == 0 else math.nan
    if e == 0:  # subnormal: 0.mantissa x 2^(1 - bias)
        return s * m * 2.0 ** (1 - bias - m_bits)
    return s * (1 + m / 2**m_bits) * 2.0 ** (e - bias)


def code_value(code: int, name: str, sign: str = "0") -> float:
    """The value of exponent and mantissa bits read together as one integer `code`."""
    e_bits, m_bits, _ = LAYOUT[name]
    word = format(code, f"0{e_bits + m_bits}b")
    return decode(sign, word[:e_bits], word[e_bits:], name)


def largest_code(name: str) -> int:
    """IEEE: exponent 1..10, mantissa all ones; E4M3fn: all ones but the last mantissa bit."""
    e_bits, m_bits, ieee = LAYOUT[name]
    return 2 ** (e_bits + m_bits) - 1 - (2**m_bits if ieee else 1)


def test_the_decoder_reads_the_seeds_table():
    # largest finite value and gap after 1.0, as the seed's table gives them
    for name, largest, gap in [("float32", (2 - 2**-23) * 2.0**127, 2**-23), ("bfloat16", (2 - 2**-7) * 2.0**127, 2**-7),
                               ("float16", 65504, 2**-10), ("float8_e4m3fn", 448, 2**-3), ("float8_e5m2", 57344, 2**-2)]:
        e_bits, m_bits, _ = LAYOUT[name]
        one = (2 ** (e_bits - 1) - 1) << m_bits  # exponent = bias, mantissa 0
        assert (code_value(one, name), code_value(largest_code(name), name)) == (1.0, largest)
        assert code_value(one + 1, name) - 1.0 == gap


@pytest.mark.parametrize("name", formats.FORMATS)
@pytest.mark.parametrize("value", VALUES)
def test_every_cell_decodes_to_the_nearest_value(name, value):
    s = formats.store(value, name)
    e_bits, m_bits, ieee = LAYOUT[name]
    assert (len(s.sign), len(s.exponent), len(s.mantissa)) == (1, e_bits, m_bits)
    assert s.sign == ("1" if math.copysign(1, value) < 0 else "0")
    held = decode(s.sign, s.exponent, s.mantissa, name)
    assert (math.isnan(held) and math.isnan(s.stored)) or held == s.stored
    top = largest_code(name)
    largest, half_gap = code_value(top, name), (code_value(top, name) - code_value(top - 1, name)) / 2
    if abs(value) >= largest + half_gap:  # rounds past the largest finite value
        assert s.status == ("overflow" if ieee else "nan")
        assert math.isinf(s.stored) if ieee else math.isnan(s.stored)
        return
    # round to nearest: neither neighbouring code is closer to the value
    code = int(s.exponent + s.mantissa, 2)
    for other in (code - 1, code + 1):
        if 0 <= other <= top:
            assert abs(s.stored - value) <= abs(code_value(other, name, s.sign) - value), other
    if s.stored == 0 and value != 0:
        assert s.status == "underflow"
    else:
        assert s.status == "ok"
        assert s.rel_error == (abs(s.stored - value) / abs(value) if value else 0.0)


def test_bit_fields_decode_to_the_stored_value():
    s = formats.store(0.1, "bfloat16")
    assert s.bits == "0 01111011 1001101"  # DESIGN §4's example
    mantissa = 1 + int(s.mantissa, 2) / 2**7
    assert s.stored == (-1) ** int(s.sign) * mantissa * 2.0 ** (int(s.exponent, 2) - 127)


def test_the_seeds_self_check_facts():
    # 1 + 0.0001 is 1 in FP16 and BF16 (half their gap after 1.0, 2^-11 and 2^-8, is larger than
    # 1e-4) but not in FP32 (2^-24)
    fp16, bf16, fp32 = (formats.store(1.0001, name) for name in ("float16", "bfloat16", "float32"))
    assert (fp16.bits, fp16.stored, fp16.status) == ("0 01111 0000000000", 1.0, "ok")
    assert (bf16.bits, bf16.stored, bf16.status) == ("0 01111111 0000000", 1.0, "ok")
    assert fp16.rel_error == pytest.approx(1e-4 / 1.0001)
    assert fp32.bits == "0 01111111 00000000000001101000111"  # 1e-4 x 2^23 = 838.86: 1 + 839 x 2^-23
    assert fp32.stored == 1 + 839 * 2.0**-23 and fp32.rel_error < 2.0**-24
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



@pytest.mark.parametrize("name", formats.FORMATS)
def test_which_casts_round_through_float32(name):
    """The report's explorer rounds a float64 into `name` through float32 exactly when
    rounds_via_float32 says so. Then every cast equals the cast of the float32-rounded value
    (2000 doubles at or 2^-30 off the midpoints of the format's neighbours, where the two
    orders of rounding would differ); otherwise some of them tell the two apart."""
    rng = np.random.default_rng(0)
    m = LAYOUT[name][1]
    midpoints = 1 + rng.integers(0, 2 ** (m + 1), 2000) * 2.0 ** -(m + 1)
    xs = (midpoints + rng.choice([-1, 0, 1], 2000) * 2.0**-30) * 2.0 ** rng.integers(-6, 6, 2000)
    direct = [formats.store(float(x), name).stored for x in xs]
    via_float32 = [formats.store(float(np.float32(x)), name).stored for x in xs]
    if formats.rounds_via_float32(name):
        assert direct == via_float32
    else:
        assert name == "float32" or direct != via_float32
