import json
import subprocess
import sys

import pytest

from conftest import ROOT
from zerojax import cli
from zerojax.analysis import formulas


def test_the_papers_numbers():
    stages = formulas.memory_report(7.5e9, 64)["stages"]
    assert [round(stages[s] / 1e9, 1) for s in "0123"] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("params, devices, k, expected", [
    # by hand: 1e9 params on 8 devices: 16e9; 4e9 + 12e9/8; 2e9 + 14e9/8; 16e9/8
    (1e9, 8, 12, [16e9, 5.5e9, 3.75e9, 2e9]),
    # 3B VLA on one GPU (the seed): 48 GB whatever the stage
    (3e9, 1, 12, [48e9] * 4),
    # K = 8 (e.g. 8-bit Adam + fp32 master), 100 params on 4 devices: 12·100; 4·100 + 8·100/4; ...
    (100, 4, 8, [1200, 400 + 200, 200 + 250, 300]),
])
def test_hand_computed_cases(params, devices, k, expected):
    got = formulas.memory_report(params, devices, k)["stages"]
    assert [got[s] for s in "0123"] == pytest.approx(expected)


def test_cli_json_and_table(capsys):
    assert cli.main(["memory", "--params", "7.5e9", "--devices", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"params": 7500000000, "devices": 64, "k": 12,
                   "stages": {"0": 120e9, "1": 31.40625e9, "2": 16.640625e9, "3": 1.875e9}}
    assert cli.main(["memory", "--params", "7.5B", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    for shown in ("120 GB", "31.4 GB", "16.6 GB", "1.9 GB", "FULL_SHARD"):
        assert shown in out


def test_params_from_a_config(capsys):
    assert cli.main(["memory", "--config", str(ROOT / "configs" / "gpt2-small.yaml"), "--devices", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    d, f, v, t, layers = 768, 3072, 50304, 1024, 12
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    assert doc["params"] == v * d + t * d + layers * block + 2 * d == 124_475_904
    assert cli.main(["memory", "--config", str(ROOT / "configs" / "tiny.yaml"), "mesh.data=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == 4


@pytest.mark.parametrize("args", [
    ["memory", "--devices", "8"],
    ["memory", "--params", "lots", "--devices", "8"],
    ["memory", "--params", "1e9", "--devices", "0"],
    ["memory", "--params", "1e9"],
    ["memory", "--config", "missing.yaml", "--devices", "2"],
    ["memory", "--params", "1e9", "--devices", "2", "--k", "-1"],
])
def test_cli_bad_input_exits_2(args, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("params, layers, seq_len, d_model, expected", [
    # GPT-2 small at T=1024 (PaLM appendix B: 6N + 12·L·T·D): 6 x 124,475,904 = 746,855,424, plus
    # attention's 12 x 12 x 1024 x 768 = 113,246,208 (15% more) = 860,101,632
    (124_475_904, 12, 1024, 768, 860_101_632),
    # configs/gpt-1b.yaml: Ψ = 50304·2048 + 2048·2048 + 24 x 50,358,272 (one block) + 2·2048
    # = 1,315,819,520; 6Ψ = 7,894,917,120; 12 x 24 x 2048 x 2048 = 1,207,959,552
    (1_315_819_520, 24, 2048, 2048, 9_102_876_672),
])
def test_flops_per_token(params, layers, seq_len, d_model, expected):
    assert formulas.flops_per_token(params, layers, seq_len, d_model) == expected


def test_the_calculator_imports_no_jax(tmp_path):
    """`zerojax memory --params` is arithmetic: a fresh interpreter answers it without importing
    jax (nor flax, optax, orbax), and so in well under a second."""
    code = ("import sys, zerojax.cli as c\n"
            "assert c.main(['memory', '--params', '7.5B', '--devices', '64', '--json']) == 0\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax', 'optax', 'orbax'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    *document, imported = proc.stdout.strip().splitlines()
    assert json.loads(document[0])["stages"]["3"] == 1.875e9
    assert imported == "[]"
