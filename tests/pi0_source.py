"""A π0 data source of the test's own (`data.source=pi0_source:build`): random cameras, prompts,
states and action chunks, with flow matching's noise and time per (seed, split, step, row)
(`zerojax.models.vla.batch.noise_and_time`), in the batch `zerojax.models.pi0.model` reads."""

from dataclasses import dataclass

import numpy as np

from zerojax import data
from zerojax.models.vla.batch import noise_and_time


@dataclass(frozen=True)
class Robot:
    cfg: object

    vocab_size = 0  # any: the prompts are drawn below the model's vocabulary

    def spec(self):
        m, B = self.cfg.model, self.cfg.train.global_batch
        a, S = m.action, m.vision.image_size
        return {"images": data.Field((B, a.cameras, 3, S, S), "float32"),
                "image_masks": data.Field((B, a.cameras), "bool"),
                "tokens": data.Field((B, a.prompt_len), "int32"), "token_mask": data.Field((B, a.prompt_len), "bool"),
                "state": data.Field((B, a.max_state_dim), "float32"),
                "actions": data.Field((B, a.horizon, a.max_action_dim), "float32"),
                "action_is_pad": data.Field((B, a.horizon), "bool"),
                "noise": data.Field((B, a.horizon, a.max_action_dim), "float32"), "time": data.Field((B,), "float32")}

    def rows(self, split, step, rows):
        m, seed = self.cfg.model, self.cfg.train.seed
        spec = self.spec()
        index = range(*rows.indices(spec["time"].shape[0]))
        out = {k: [] for k in spec if k not in ("noise", "time")}
        for row in index:
            rng = np.random.default_rng((seed, split, step, row))
            one = {
                "images": rng.uniform(-1, 1, spec["images"].shape[1:]).astype(np.float32),
                "image_masks": np.arange(m.action.cameras) < rng.integers(1, m.action.cameras + 1),
                "tokens": rng.integers(0, m.vocab_size, m.action.prompt_len).astype(np.int32),
                "token_mask": np.arange(m.action.prompt_len) < rng.integers(1, m.action.prompt_len + 1),
                "state": rng.standard_normal(m.action.max_state_dim).astype(np.float32),
                "actions": rng.standard_normal(spec["actions"].shape[1:]).astype(np.float32),
                "action_is_pad": np.arange(m.action.horizon) >= rng.integers(1, m.action.horizon + 1),
            }
            for k, v in one.items():
                out[k].append(v)
        batch = {k: np.stack(v) for k, v in out.items()}
        batch["noise"], batch["time"] = noise_and_time(seed, split, step, index, m.action.horizon,
                                                       m.action.max_action_dim)
        return batch


def build(*, cfg):
    return Robot(cfg)
