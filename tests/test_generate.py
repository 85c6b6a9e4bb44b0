"""Generation with a key/value cache (zerojax.train.sample, `zerojax generate`): decoding equals
the full forward, greedy equals transformers' greedy `generate` (tests/fixtures/chat/greedy.json,
made by scripts/fixtures/make_chat_fixtures.py), and `zerojax generate --chat` on a trained run."""

import io
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, one_error_line
from zerojax import cli, config
from zerojax.interop import hf
from zerojax.models import registry
from zerojax.precision import Policy
from zerojax.train import sample

FAMILIES = {"gpt": [], "llama": ["model.n_kv_heads=1"], "gemma": ["model.n_kv_heads=1", "model.head_dim=8"]}
CHAT = ROOT / "tests" / "fixtures" / "chat"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_then_one_token_at_a_time_is_the_full_forward(family):
    cfg = config.load(overrides=[f"model.family={family}", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                                 "model.d_ff=64", "model.seq_len=16", *FAMILIES[family]])
    model = registry.build(cfg.model, Policy(), seed=0)
    graphdef, params = nnx.split(model)
    prefill = jax.jit(lambda p, t, pos: nnx.merge(graphdef, p).decode(t, pos, 16))
    step = jax.jit(lambda p, t, pos, cache: nnx.merge(graphdef, p).decode(t, pos, cache))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)), jnp.int32)
    logits, cache = prefill(params, tokens[:, :5], jnp.arange(5)[None])
    steps = [logits]
    for t in range(5, 12):
        logits, cache = step(params, tokens[:, t:t + 1], jnp.array([[t]]), cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), model.logits(tokens), atol=1e-5, rtol=0)


def test_greedy_generation_is_transformers_greedy_generate():
    reference = json.loads((CHAT / "greedy.json").read_text())
    _, model = hf.load(str(ROOT / reference["model"]))
    graphdef, params = nnx.split(model)
    generator = sample.Generator(lambda p: nnx.merge(graphdef, p), params, 64, True, temperature=0.0)
    for run in reference["runs"]:
        ids, stats = generator.generate(run["prompt"], reference["max_new_tokens"], seed=0)
        assert ids[len(run["prompt"]):] == run["new"]
        assert stats.new_tokens == 20 and stats.tokens_per_s > 0
    assert set(generator._jitted) == {"step"}  # prompts this short go through the step; the chat test prefills
    # a model without `decode` re-runs its window for each token: the same tokens
    window = sample.Generator(lambda p: nnx.merge(graphdef, p), params, 64, False, temperature=0.0)
    run = reference["runs"][0]
    assert window.generate(run["prompt"], 20, seed=0)[0][len(run["prompt"]):] == run["new"]


def test_a_full_context_restarts_from_its_last_half_not_at_every_token():
    # The end-of-run sample of a 16-token model runs 40 tokens past its context: each restart
    # keeps at most half the context, so the step runs once per token fed, and the empty
    # cache's shapes are traced once.
    cfg = config.load(overrides=["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
                                 "model.seq_len=16"])
    graphdef, params = nnx.split(registry.build(cfg.model, Policy(), seed=0))
    generator = sample.Generator(lambda p: nnx.merge(graphdef, p), params, 16, True, temperature=0.0)
    calls = {"start": 0}
    real = generator._start

    def counted(context, key):
        calls["start"] += 1
        assert len(context) <= 8 or calls["start"] == 1, len(context)
        return real(context, key)

    generator._start = counted
    ids, stats = generator.generate(list(b"def "), 40, seed=0)
    assert stats.new_tokens == 40 and len(ids) == 44
    assert calls["start"] <= 1 + 40 // 8, calls  # the prompt, then a restart per 8 new tokens at most
    assert set(generator._jitted) == {"step"}


def test_generate_prompt_and_the_sampling_options(capsys):
    # --prompt on a directory without a tokenizer: bytes in and out, greedy as transformers'.
    run = json.loads((CHAT / "greedy.json").read_text())["runs"][0]
    prompt = bytes(run["prompt"]).decode()
    assert cli.main(["generate", str(ROOT / "tests/fixtures/hf/llama-gqa"), "--prompt", prompt, "--temperature", "0",
                     "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == bytes(run["new"]).decode("utf-8", errors="replace") + "\n"
    for flags, message in ((["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
                           (["--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0")):
        assert cli.main(["generate", "x", "--prompt", "a", *flags]) == 2
        assert message in capsys.readouterr().err
    # nucleus sampling with a tiny top_p keeps the most likely token only; temperature 1 samples
    logits = jnp.array([0.0, 2.0, 1.0, -1.0])
    keys = jax.random.split(jax.random.key(0), 64)
    assert {int(sample.pick(logits, k, 1.0, 1e-3)) for k in keys} == {1}
    assert len({int(sample.pick(logits, k, 1.0, 1.0)) for k in keys}) >= 3


def test_generate_chat_replies_as_transformers_does(monkeypatch, capsys):
    # A Hugging Face chat model's directory (tests/fixtures/chat/llama3: model, tokenizer, template):
    # the user's turn through the template, greedy decoding to <|eot_id|>, the reply decoded.
    reference = json.loads((CHAT / "greedy.json").read_text())["chat"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(reference["messages"][0]["content"] + "\n"))
    code = cli.main(["generate", str(ROOT / reference["model"]), "--chat", "--temperature", "0",
                     "--max-new-tokens", str(reference["max_new_tokens"])])
    out, err = capsys.readouterr()
    assert code == 0 and out == reference["reply"] + "\n", (out, err)
    assert f"{len(reference['new'])} new tokens after {len(reference['prompt'])}:" in err and "tokens/s" in err


def test_chat_without_a_template_is_said_before_the_checkpoint_is_read(tmp_path, capsys):
    """The cheap check first: the weights here are not even a safetensors file."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_bytes((CHAT / "llama3" / name).read_bytes())
    (model / "model.safetensors").write_text("not tensors")
    line = one_error_line(["generate", str(model), "--chat"], capsys)
    assert f"--chat: the tokenizer in {model} has no chat template" in line, line


def test_the_sft_recipe_then_generate_chat_on_its_run(tmp_path, monkeypatch, capsys):
    # configs/sft-llama.yaml (its fixture paths made absolute: the chat fixture model, packed chat rows, ZeRO-3 on 8
    # devices), two steps; then `zerojax generate RUN_DIR --chat` reads two turns from stdin.
    run = tmp_path / "run"
    assert cli.main(["generate", str(tmp_path), "--chat"]) == 2  # a directory without a checkpoint
    assert "holds no checkpoints/ directory" in capsys.readouterr().err
    assert cli.main(["train", "--no-progress", "--config", str(ROOT / "configs" / "sft-llama.yaml"), "train.steps=2",
                     f"model.init_from={CHAT / 'llama3'}", f"data.tokenizer={CHAT / 'llama3'}",  # tests run elsewhere
                     f"data.source={CHAT / 'sft.jsonl'}", "model.seq_len=64", "train.global_batch=8", "train.eval_every=0", "train.ckpt_every=2", "train.report=false", f"train.out_dir={run}"]) == 0
    assert (run / "sample.txt").read_text()  # the end-of-run sample: a reply through the chat template
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("seven\nand again\n"))
    assert cli.main(["generate", str(run), "--chat", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) >= 2 and err.count("new tokens after") == 2, (out, err)
    # the second turn's prompt holds the first exchange: a longer prefill
    prompts = [int(line.split("new tokens after ")[1].split(":")[0]) for line in err.splitlines() if "after" in line]
    assert prompts[1] > prompts[0] + 4
