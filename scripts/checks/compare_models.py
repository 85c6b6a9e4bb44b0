"""Two trees' models compared bit for bit: each family's initial parameters (seed 0), a policy's
flow-matching losses and sampled actions (plain and RTC-guided) and FLOPs, a language model's
logits, and every checkpoint layout table (HF, LeRobot, openpi). For a restructure that must
change nothing:

    git worktree add /tmp/base REV
    python scripts/checks/compare_models.py dump /tmp/new.pkl                     (in this tree)
    (cd /tmp/base && PYTHONPATH=. python /path/to/compare_models.py dump /tmp/old.pkl)
    python scripts/checks/compare_models.py diff /tmp/old.pkl /tmp/new.pkl

Tiny sizes, one CPU device; RTC is imported from wherever the tree keeps it.
"""

import importlib
import os
import pickle
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

POLICY = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
          "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=32",
          "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16",
          "model.vision.n_layers=1", "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=3",
          "model.action.prompt_len=6", "model.action.max_state_dim=8", "model.action.max_action_dim=4",
          "model.action.cameras=2", "data.image_size=8", "data.action_horizon=3", "data.prompt_len=6"]
LM = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64"]
KEYS = {"pi0": POLICY, "pi05": POLICY, "smolvla": POLICY + ["model.head_dim=16"], "llama": LM,
        "gemma": LM + ["model.head_dim=16"]}
MODEL = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8, "d_ff": 32,
         "expert": {"d_model": 16, "d_ff": 32}, "vision": {"image_size": 8, "n_heads": 2}, "seq_len": 16,
         "rope_theta": 1e4, "tie_embeddings": None, "smolvla": {},
         "action": {"horizon": 3, "max_state_dim": 8, "max_action_dim": 4, "prompt_len": 6}}


def rtc():
    for name in ("zerojax.models.vla.rtc", "zerojax.models.rtc"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no rtc module in this tree")


def policy_outputs(model) -> dict:
    rng, (B, H, A) = np.random.default_rng(0), (2, 3, 4)
    batch = {"images": rng.uniform(-1, 1, (B, 2, 3, 8, 8)).astype(np.float32),
             "image_masks": np.array([[1, 1], [1, 0]], bool), "tokens": rng.integers(0, 256, (B, 6)).astype(np.int32),
             "token_mask": np.array([[1] * 6, [1] * 3 + [0] * 3], bool),
             "state": rng.normal(size=(B, 8)).astype(np.float32),
             "actions": rng.normal(size=(B, H, A)).astype(np.float32), "action_is_pad": np.zeros((B, H), bool)}
    noise, time = rng.normal(size=(B, H, A)).astype(np.float32), np.array([0.3, 0.8], np.float32)
    guide = rtc().Guide(leftover=jnp.ones((B, H, A)) * 0.1, weights=jnp.ones((B, H)), jacobian=True)
    return {"loss": np.asarray(model.flow_loss(batch, noise, time)),
            "actions": np.asarray(model.sample_actions(batch, noise, num_steps=3)),
            "guided": np.asarray(model.sample_actions(batch, noise, num_steps=3, guide=guide)),
            "flops": np.asarray(model.flops_per_token(0))}


def tables(record) -> dict:
    out = {}
    if record.hf:
        out["hf"] = {k: tuple(vars(v).values()) for k, v in record.hf.tensors.items()}
    if record.lerobot:
        lr = record.lerobot
        out["lerobot"] = {k: tuple(vars(v).values()) for k, v in lr.tensors.items()}
        out["lerobot config"] = (lr.to_config(MODEL, {}), lr.to_config(MODEL, {"resize_imgs_with_padding": [1, 1]}))
        out["lerobot processors"] = lr.processors({"tokenizer_max_length": 6}) if lr.processors else None
        out["lerobot extras"] = (lr.unused(MODEL) if lr.unused else None, lr.aliases)
    if record.openpi:
        out["openpi"] = ([(r.zerojax, r.openpi) for r in record.openpi.rules(MODEL)], record.openpi.heads)
    return out


def dump(path: str) -> None:
    from zerojax import config
    from zerojax.models import registry
    from zerojax.precision import Policy

    out = {}
    for family in registry.FAMILIES:
        result = {"tables": tables(registry.family(family))}
        if family in KEYS:
            model = registry.build(config.load(overrides=[f"model.family={family}", *KEYS[family]]).model, Policy(), 0)
            leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
            result["params"] = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
            result.update(policy_outputs(model) if registry.is_policy(family) else
                          {"logits": np.asarray(model.logits(jnp.arange(8)[None]))})
        out[family] = result
    with open(path, "wb") as f:
        pickle.dump(out, f)


def differences(old: dict, new: dict) -> list[str]:
    out = []
    for family in sorted(set(old) | set(new)):
        a, b = old.get(family, {}), new.get(family, {})
        for key in sorted(set(a) | set(b)):
            if key == "params":
                names = set(a[key]) ^ set(b[key])
                out += [f"{family}: parameter {n} in one tree only" for n in sorted(names)]
                out += [f"{family}: parameter {n} differs" for n in sorted(set(a[key]) & set(b[key]))
                        if not np.array_equal(a[key][n], b[key][n])]
            elif key == "tables":
                out += [f"{family}: table {t} differs" for t in sorted(set(a[key]) | set(b[key]))
                        if a[key].get(t) != b[key].get(t)]
            elif key not in a or key not in b or not np.array_equal(a[key], b[key]):
                out.append(f"{family}: {key} differs")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["dump"] and len(argv) == 2:
        dump(argv[1])
        return 0
    if argv[:1] == ["diff"] and len(argv) == 3:
        with open(argv[1], "rb") as f, open(argv[2], "rb") as g:
            found = differences(pickle.load(f), pickle.load(g))
        print("\n".join(found) or "identical: parameters, outputs and tables of every family")
        return 1 if found else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
