"""Meta-World's tasks as a policy of zerojax sees them (and as `zerojax collect`, sim/collect.py,
records them): LeRobot's set-up (lerobot/envs/metaworld.py, LeRobot 0.4) with the goal made
observable and the rendering made cheap.

    observation.state            float32 [39]   Meta-World's observation: the hand's position and
                                                gripper, the objects' poses, the same of the
                                                step before, and the goal's position (MT1 hides
                                                the goal; here it is shown, as in Meta-World's
                                                `goal_observable` environments)
    observation.images.corner2   uint8 [S, S, 3] the corner2 camera, moved and flipped as LeRobot
                                                does, rendered without shadows or multisampling
                                                (a 4096-pixel shadow map costs 0.2 s a frame on
                                                a CPU; without it, 20 ms at 64 x 64); another of
                                                Meta-World's cameras (CAMERAS) where one is named:
                                                observation.images.<camera>, where Meta-World puts it
    action                       float32 [4]    the hand's xyz motion and the gripper, in [-1, 1]

A task's episodes are MT1's: `metaworld.MT1(task, seed=42)`'s first training task with its
random vector unfrozen (LeRobot's choice), and episode e of seed s starts from
`reset(seed=s + e)`, so the same seed gives the same initial states. An episode succeeds when
`info["success"]` is set at any step; it ends there or at the task's max_path_length (500).
The instructions are LeRobot's (its metaworld_config.json).

A `Shift` changes the scene an evaluation renders and nothing the state says, for a policy to be
judged on what its training data never showed: the lights' brightness, a colour cast of every
material, and the camera moved by a few centimetres.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zerojax.errors import ConfigError

FPS = 80  # LeRobot's MetaworldEnv render_fps
CAMERA = "corner2"
CAMERAS = ("corner", "corner2", "corner3", "topview", "behindGripper", "gripperPOV")  # the scenes' own
IMAGE_PREFIX = "observation.images."
STATE_KEY, IMAGE_KEY = "observation.state", f"{IMAGE_PREFIX}{CAMERA}"
CORNER2_POS = (0.75, 0.075, 0.7)  # LeRobot's corner2 position (arXiv 2206.14244)
BENCHMARK_SEED = 42  # LeRobot's metaworld.MT1(task, seed=42)

INSTRUCTIONS = {  # LeRobot 0.4's lerobot/envs/metaworld_config.json TASK_DESCRIPTIONS
    'assembly-v3': 'Pick up a nut and place it onto a peg',
    'basketball-v3': 'Dunk the basketball into the basket',
    'bin-picking-v3': 'Grasp the puck from one bin and place it into another bin',
    'box-close-v3': 'Grasp the cover and close the box with it',
    'button-press-topdown-v3': 'Press a button from the top',
    'button-press-topdown-wall-v3': 'Bypass a wall and press a button from the top',
    'button-press-v3': 'Press a button',
    'button-press-wall-v3': 'Bypass a wall and press a button',
    'coffee-button-v3': 'Push a button on the coffee machine',
    'coffee-pull-v3': 'Pull a mug from a coffee machine',
    'coffee-push-v3': 'Push a mug under a coffee machine',
    'dial-turn-v3': 'Rotate a dial 180 degrees',
    'disassemble-v3': 'Pick a nut out of a peg',
    'door-close-v3': 'Close a door with a revolving joint',
    'door-lock-v3': 'Lock the door by rotating the lock clockwise',
    'door-open-v3': 'Open a door with a revolving joint',
    'door-unlock-v3': 'Unlock the door by rotating the lock counter-clockwise',
    'hand-insert-v3': 'Insert the gripper into a hole',
    'drawer-close-v3': 'Push and close a drawer',
    'drawer-open-v3': 'Open a drawer',
    'faucet-open-v3': 'Rotate the faucet counter-clockwise',
    'faucet-close-v3': 'Rotate the faucet clockwise',
    'hammer-v3': 'Hammer a screw on the wall',
    'handle-press-side-v3': 'Press a handle down sideways',
    'handle-press-v3': 'Press a handle down',
    'handle-pull-side-v3': 'Pull a handle up sideways',
    'handle-pull-v3': 'Pull a handle up',
    'lever-pull-v3': 'Pull a lever down 90 degrees',
    'peg-insert-side-v3': 'Insert a peg sideways',
    'pick-place-wall-v3': 'Pick a puck, bypass a wall and place the puck',
    'pick-out-of-hole-v3': 'Pick up a puck from a hole',
    'reach-v3': 'Reach a goal position',
    'push-back-v3': 'Push the puck to a goal',
    'push-v3': 'Push the puck to a goal',
    'pick-place-v3': 'Pick and place a puck to a goal',
    'plate-slide-v3': 'Slide a plate into a cabinet',
    'plate-slide-side-v3': 'Slide a plate into a cabinet sideways',
    'plate-slide-back-v3': 'Get a plate from the cabinet',
    'plate-slide-back-side-v3': 'Get a plate from the cabinet sideways',
    'peg-unplug-side-v3': 'Unplug a peg sideways',
    'soccer-v3': 'Kick a soccer into the goal',
    'stick-push-v3': 'Grasp a stick and push a box using the stick',
    'stick-pull-v3': 'Grasp a stick and pull a box with the stick',
    'push-wall-v3': 'Bypass a wall and push a puck to a goal',
    'reach-wall-v3': 'Bypass a wall and reach a goal',
    'shelf-place-v3': 'Pick and place a puck onto a shelf',
    'sweep-into-v3': 'Sweep a puck into a hole',
    'sweep-v3': 'Sweep a puck off the table',
    'window-open-v3': 'Push and open a window',
    'window-close-v3': 'Push and close a window',
}


def check_tasks(tasks: list[str]) -> None:
    """ConfigError for an unknown task, listing the known ones."""
    unknown = [t for t in tasks if t not in INSTRUCTIONS]
    if unknown or not tasks:
        raise ConfigError(f"metaworld: unknown task {', '.join(map(repr, unknown)) or '(none given)'}; "
                          f"Meta-World's tasks: {', '.join(INSTRUCTIONS)}")


def check_camera(camera: str) -> None:
    if camera not in CAMERAS:
        raise ConfigError(f"metaworld: no camera {camera!r}; Meta-World's cameras: {', '.join(CAMERAS)}")


def image_key(camera: str) -> str:
    return f"{IMAGE_PREFIX}{camera}"


def check_features(features: dict, where: str) -> tuple[int, str]:
    """(the camera size, the camera) of a run trained on these features, or a ConfigError where
    they are not a Meta-World dataset's (`zerojax collect`'s: the state, the action, one camera)."""
    state, action = (features.get(k, {}).get("shape") for k in (STATE_KEY, "action"))
    cameras = [k[len(IMAGE_PREFIX):] for k in features if k.startswith(IMAGE_PREFIX)]
    if state != [39] or action != [4] or len(cameras) != 1 or cameras[0] not in CAMERAS:
        have = ", ".join(f"{k} {v.get('shape')}" for k, v in features.items())
        raise ConfigError(f"{where} was not trained on Meta-World's features ({STATE_KEY} [39], action [4], "
                          f"one of its cameras as {IMAGE_PREFIX}CAMERA: a dataset of `zerojax collect`); its "
                          f"features: {have}")
    return int(features[image_key(cameras[0])]["shape"][0]), cameras[0]


@dataclass(frozen=True)
class Shift:
    """What an evaluation changes in the rendered scene (module docstring): `brightness` scales
    every light (the headlight's too), `colour` multiplies the RGB of every material and geom
    (a colour cast, clipped to 1), `camera` moves the camera by (dx, dy, dz) metres."""

    brightness: float = 1.0
    colour: tuple = (1.0, 1.0, 1.0)
    camera: tuple = (0.0, 0.0, 0.0)

    @classmethod
    def parse(cls, items: list[str]) -> "Shift":
        """From KEY=VALUE items: brightness=F, colour=R,G,B, camera=DX,DY,DZ (metres)."""
        fields, sizes = {}, {"brightness": 1, "colour": 3, "camera": 3}
        for item in items:
            key, _, value = item.partition("=")
            try:
                numbers = tuple(float(v) for v in value.split(","))
            except ValueError:
                numbers = ()
            if key not in sizes or len(numbers) != sizes[key] or (key != "camera" and min(numbers) < 0):
                raise ConfigError(f"shift {item!r}: give brightness=F (F >= 0, 1 = as trained), colour=R,G,B (each a "
                                  "factor >= 0 on the materials' red, green and blue) or camera=DX,DY,DZ (metres)")
            fields[key] = numbers[0] if key == "brightness" else numbers
        return cls(**fields)

    def apply(self, model, camera_id: int) -> None:
        if self.brightness != 1.0:
            for lights in (model.light_diffuse, model.light_ambient, model.light_specular):
                lights *= self.brightness
            headlight = model.vis.headlight
            headlight.diffuse, headlight.ambient = headlight.diffuse * self.brightness, headlight.ambient * self.brightness
        if self.colour != (1.0, 1.0, 1.0):
            for rgba in (model.mat_rgba, model.geom_rgba):
                rgba[:, :3] = np.clip(rgba[:, :3] * np.asarray(self.colour, np.float32), 0.0, 1.0)
        model.cam_pos[camera_id] += np.asarray(self.camera)

    def describe(self) -> str:
        said = [f"brightness x{self.brightness:g}"] * (self.brightness != 1.0)
        said += [f"colour x({','.join(f'{c:g}' for c in self.colour)})"] * (self.colour != (1.0, 1.0, 1.0))
        said += [f"camera moved ({','.join(f'{c:g}' for c in self.camera)}) m"] * any(self.camera)
        return ", ".join(said) or "none"


class Env:
    """One Meta-World task (module docstring). `reset(seed)` and `step(action)` give the
    observation dict; `render` is called only when an observation is read."""

    def __init__(self, task: str, size: int = 64, camera: str = CAMERA, shift: Shift | None = None):
        import metaworld
        from metaworld.policies import ENV_POLICY_MAP

        check_tasks([task])
        check_camera(camera)
        self.task, self.size, self.instruction = task, size, INSTRUCTIONS[task]
        self.image_key = image_key(camera)
        benchmark = metaworld.MT1(task, seed=BENCHMARK_SEED)
        env = benchmark.train_classes[task](render_mode="rgb_array", camera_name=camera, width=size, height=size)
        env.set_task(benchmark.train_tasks[0])  # MT1's tasks set partially_observable=False: the goal is shown
        env._partially_observable = False
        if camera == CAMERA:
            env.model.cam_pos[env.model.camera(CAMERA).id] = CORNER2_POS
        (shift or Shift()).apply(env.model, env.model.camera(camera).id)
        env.model.vis.quality.shadowsize = 0
        env.model.vis.quality.offsamples = 0
        env.model.vis.global_.offwidth = env.model.vis.global_.offheight = size
        env._freeze_rand_vec = False  # otherwise every episode starts alike (LeRobot's note)
        env.seeded_rand_vec = True  # the random vector from the env's seeded np_random (seed()), not numpy's global one
        self.env, self.expert = env, ENV_POLICY_MAP[task]()
        self.max_steps = int(env.max_path_length)
        self.raw = None

    def reset(self, seed: int) -> dict:
        self.env.seed(seed)  # reset ignores its seed argument; seed() seeds the random vector
        self.raw, _ = self.env.reset()
        return self.observation()

    def step(self, action) -> tuple[dict, bool]:
        """(observation, success) after one action, clipped to the action space as Meta-World does."""
        self.raw, _, _, _, info = self.env.step(np.clip(np.asarray(action, np.float32), -1.0, 1.0))
        return self.observation(), bool(info["success"])

    def observation(self) -> dict:
        return {STATE_KEY: np.asarray(self.raw, np.float32), "prompt": self.instruction}

    def image(self) -> np.ndarray:
        """uint8 [S, S, 3]: the camera now (Meta-World's cameras render upside down and mirrored;
        flipped back)."""
        try:
            frame = self.env.render()
        except Exception as err:  # no OpenGL: MuJoCo's GL loader fails on the first render
            raise ConfigError(f"MuJoCo cannot render ({type(err).__name__}: {err}); without a display it needs "
                              "OSMesa (apt-get install libosmesa6, MUJOCO_GL=osmesa) or EGL (MUJOCO_GL=egl)") from None
        return np.ascontiguousarray(np.flip(frame, (0, 1)))

    def expert_action(self) -> np.ndarray:
        return np.asarray(self.expert.get_action(self.raw), np.float32)

    def close(self) -> None:
        self.env.close()
