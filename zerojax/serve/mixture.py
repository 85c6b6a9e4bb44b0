"""A mixture run served (data.source=mixture, zerojax/data/mixture.py): each request names its
dataset, and is read and answered with that dataset's features and statistics, as training read
that dataset's frames. This is what neither openpi nor LeRobot does: their policies hold one
normalization, so a policy trained on two robots answers one of them in the other's units.

A request is a single dataset run's observation (observation.py) and one key more:

    dataset   str   a dataset of the run's data.mixture: its directory as data.mixture names it,
                    or that directory's name where no other dataset of the mixture shares it

The observation holds that dataset's state and cameras. Its row is built as
`zerojax.data.mixture` built the dataset's rows in training: the state normalized with the
dataset's statistics and zero-padded to the mixture's width, each camera in its slot of the
mixture's, a slot the dataset lacks all -1 and masked. The chunk is cut to the dataset's action
width and unnormalized with its statistics, and where the run's actions are relative
(model.action.relative: each dataset's record carries its relative_actions) the request's own
state is added back on that dataset's joints: float32 [H, D_a] of that robot. A request without
the key, or naming no dataset of the run, is refused with the names it may give.

The run's RUN_DIR/mixture.json holds each dataset's features and statistics (its lerobot.json
record) and the camera slots; a safetensors export carries it in its metadata (export.RUN_FILES).
"""

from __future__ import annotations

from zerojax.data.lerobot.relative import RECORD as RELATIVE
from zerojax.data.mixture import choices, names
from zerojax.models.family import STATE
from zerojax.serve.observation import DATASET, ObservationError, Observations, width


class Datasets:
    """The observations of a mixture run (module docstring): one `Observations` a dataset, and
    the request's `member`; what the policy asks of all of them (`blank`, `robot_actions` of a
    batch of rows of several datasets, the metadata) answered over the datasets."""

    def __init__(self, doc: dict, tokenizer, image_size: int, prompt_len: int, model_keys: dict,
                 pad_before: bool = False):
        records = [d["lerobot.json"] for d in doc["datasets"]]
        self.model_keys = model_keys
        self.roots = [d["dataset"] for d in doc["datasets"]]
        self.fps = [r.get("fps", 0.0) for r in records]
        slots = tuple(doc["camera_slots"])
        state_width = max(width(r["features"][STATE]) for r in records)
        self.members = [Observations(r["features"], r["normalization"], tokenizer, image_size, prompt_len, model_keys,
                                     pad_before, relative=r.get(RELATIVE), slots=slots, state_width=state_width,
                                     index=i) for i, r in enumerate(records)]
        # model.action.relative is the run's: a record of any dataset's says its rows carry their state
        self.relative = next((m.relative for m in self.members if m.relative), None)
        self.names = names(self.roots)
        first = self.members[0]
        self.adapter, self.pad_before, self.horizon, self.chunk_width = (first.adapter, first.pad_before, first.horizon,
                                                                          first.chunk_width)
        self.cameras, self.state_dim = list(slots), state_width
        self.action_dim = max(m.action_dim for m in self.members)

    def member(self, obs) -> Observations:
        """The observations of the dataset `obs` names; ObservationError naming the choices."""
        given = obs.get(DATASET) if isinstance(obs, dict) else None
        if not isinstance(given, str) or given not in self.names:
            what = f"{DATASET!r}={given!r} names none of them" if isinstance(obs, dict) and DATASET in obs \
                else f"it gives no {DATASET!r}"
            raise ObservationError(f"observation: this policy trained on a mixture of datasets, so a request names "
                                   f"its dataset under {DATASET!r}: one of {self.choices()}; {what}")
        return self.members[self.names[given]]

    def choices(self) -> str:
        return choices(self.roots)

    def robot_actions(self, actions, state, datasets) -> list:
        """Each row's chunk [H, chunk width] cut to its dataset's action width and unnormalized with
        its statistics, its own `state` [D_s] (the robot's units; None: no dataset's actions are
        relative) added back where its dataset's actions are relative: a list of float32 [H, D_a]
        (the datasets' widths differ)."""
        state = [None] * len(actions) if state is None else state
        return [self.members[int(m)].robot_actions(a, s) for a, s, m in zip(actions, state, datasets)]

    def blank(self) -> dict:
        """The first dataset's blank observation (warm-up: every dataset's row has the same shapes)."""
        return {**self.members[0].blank(), DATASET: self.roots[0]}

    def describe(self) -> dict:
        """The server's metadata: the datasets a request may name, and each one's own."""
        shapes = self.camera_shapes
        observation = {DATASET: {"dtype": "str", "names": list(self.names)},
                       **{c: {"shape": list(shape), "dtype": "uint8"} for c, shape in shapes.items()},
                       "prompt": {"dtype": "str"}}
        each = {root: {**m.describe(), "fps": fps} for root, m, fps in zip(self.roots, self.members, self.fps)}
        return {"observation": observation, "action_dim": None, "action_names": None, "datasets": each}

    @property
    def camera_shapes(self) -> dict:
        out = {}
        for m in self.members:
            out.update({c: s for c, s in m.camera_shapes.items() if c not in out})
        return {c: out[c] for c in self.cameras if c in out}

    @property
    def expected_keys(self) -> tuple:
        return (DATASET, STATE, *self.cameras, "prompt")
